"""`t5lite convert`: import a Hugging Face T5, fine-tune from it, export it back."""

import json

import numpy as np
import pytest
from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs the [hf] extra")


def _t5_hf(tmp_path, vocab_size):
    """A tiny random T5.1.1 (gated-GELU, untied, shared input embedding) saved to disk."""
    import torch

    cfg = transformers.T5Config(
        vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
        pad_token_id=0, tie_word_embeddings=False,  # sets scale_decoder_outputs=False
    )  # fmt: skip
    cfg.tie_word_embeddings = False  # transformers 5.x forces True in the constructor
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    model.encoder.embed_tokens = model.decoder.embed_tokens = model.shared
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_import_finetune_export_round_trip(tmp_path, capsys):
    hf_dir = _t5_hf(tmp_path, vocab_size=384)  # the byte tasks use 259 ids
    out = tmp_path / "imported"
    assert run_cli("convert", "--direction=import", f"--hf_dir={hf_dir}", f"--out_dir={out}") == 0
    assert (out / "checkpoint_0" / "COMMIT").exists()
    model_gin = (out / "model.gin").read_text()
    assert "network.T5Config.emb_dim = 32" in model_gin
    # Importing again would overwrite: refused with one line.
    capsys.readouterr()
    assert run_cli("convert", "--direction=import", f"--hf_dir={hf_dir}", f"--out_dir={out}") == 1
    assert "refusing to overwrite" in capsys.readouterr().err

    # Fine-tune from it for one step with a zero learning rate: parameters unchanged.
    run_dir = tmp_path / "run"
    args = [
        "train", "--gin_file=runs/pretrain.gin", f"--gin_file={out / 'model.gin'}",
        f"--gin.MODEL_DIR='{run_dir}'", "--gin.TASK='synthetic_reverse'", "--gin.TRAIN_STEPS=1",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 8, 'targets': 8}", "--gin.BATCH_SIZE=8",
        "--gin.EncoderDecoderModel.optimizer=@AdamW()", "--gin.AdamW.learning_rate=0.0",
        f"--gin.CheckpointConfig.init_checkpoint='{out / 'checkpoint_0'}'",
        "--gin.train.evaluation=None",
    ]  # fmt: skip
    # A task whose ids exceed the model's vocabulary is refused, naming both sizes.
    capsys.readouterr()
    assert run_cli(*args, "--gin.network.T5Config.vocab_size=200") == 1
    assert ("feature 'inputs' has a vocabulary of 259 ids but the model's vocab_size is 200"
            in capsys.readouterr().err)  # fmt: skip
    assert run_cli(*args) == 0

    exported = tmp_path / "exported"
    assert run_cli("convert", "--direction=export", f"--checkpoint={run_dir / 'checkpoint_1'}",
               f"--out_dir={exported}") == 0  # fmt: skip
    a = safetensors_numpy.load_file(hf_dir / "model.safetensors")
    b = safetensors_numpy.load_file(exported / "model.safetensors")
    assert set(a) <= set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert json.loads((exported / "config.json").read_text())["d_model"] == 32
    transformers.T5ForConditionalGeneration.from_pretrained(exported)
