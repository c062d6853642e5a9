"""seqio_lite: seqio-style tasks and deterministic data pipelines without TensorFlow."""
