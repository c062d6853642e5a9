"""Hugging Face interop: `weights.py` maps T5 / Llama weights both ways; `convert.py` is the
`t5lite convert` command (a t5lite checkpoint + `model.gin` from an HF directory, and back)."""
