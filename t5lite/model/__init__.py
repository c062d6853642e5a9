"""Model code: primitives, architectures, the models' loss/score/predict, losses, optimizers and
decoding. Only logical axis names appear here; no mesh axis, no gin, no I/O.

- `layers.py`: primitives (dense, attention, MLP, norms, embeddings), each with logical axes.
- `network.py`: the architectures (T5.1.1 encoder-decoder, decoder-only), one frozen config each.
- `models.py`: loss, eval metrics, scoring and prediction around a network (t5x's BaseModel).
- `losses.py`, `optimizers.py`, `decoding.py`: cross-entropy, Adafactor/AdamW, KV-cached decoding.
"""
