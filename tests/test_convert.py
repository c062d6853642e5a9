"""`t5lite convert`: import a Hugging Face T5, fine-tune from it, export it back."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import run_cli

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="needs the [hf] extra")

import hf_models  # noqa: E402


def test_import_finetune_export_round_trip(tmp_path, capsys):
    import shutil

    hf_models.t5_hf(tmp_path, vocab_size=384)  # the byte tasks use 259 ids
    hf_dir = tmp_path / "hf"
    # With a tokenizer: its gin bindings must not disturb a training run.
    shutil.copyfile(_sentencepiece(tmp_path), hf_dir / "spiece.model")
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
    exported_cfg = json.loads((exported / "config.json").read_text())
    assert exported_cfg["d_model"] == 32
    # The ids went through training too (recorded with every checkpoint).
    ids = ("pad_token_id", "eos_token_id", "decoder_start_token_id")
    assert [exported_cfg[k] for k in ids] == [0, 1, 0]
    transformers.T5ForConditionalGeneration.from_pretrained(exported)


# --- special ids, attention type, tokenizer files ----------------------------------------------


def _parse_model_gin(path):
    """Parses an imported `model.gin` (with the t5lite registry); returns gin, for queries."""
    import gin

    from t5lite.cli import registry  # noqa: F401  (registers the configurables)

    gin.clear_config()
    gin.parse_config_file(str(path))
    return gin


def test_llama_import_keeps_ids_and_causal_prompts(tmp_path):
    """A Llama with bos 1 / eos 2: imported, its model.gin decodes like transformers' generate
    (causal prompts, BOS first, stops at 2 and not at 1); export writes the ids back."""
    import jax
    import torch

    from t5lite.checkpoint import restore_checkpoint
    from t5lite.hf import convert

    hf = hf_models.llama_hf(tmp_path)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == (1, 2, None)
    with torch.no_grad():  # make both 1 and 2 likely: only 2 may end a row
        hf.lm_head.weight[1] = hf.lm_head.weight[38] + 0.01  # 38 and 50: frequent greedy picks
        hf.lm_head.weight[2] = hf.lm_head.weight[50] + 0.01
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "imported"
    convert.hf_to_t5lite(tmp_path / "hf", out)
    text = (out / "model.gin").read_text()
    for line in ("DecoderOnlyModel.eos_id = 2", "DecoderOnlyModel.pad_id = 0",
                 "DecoderOnlyModel.decoder_start_token_id = 1",
                 "DecoderOnlyModel.inputs_bidirectional_attention = False",
                 "# NOTE: HF pad_token_id is not set"):  # fmt: skip
        assert line in text
    gin = _parse_model_gin(out / "model.gin")
    try:
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config()
    assert (model.eos_id, model.pad_id, model.decoder_start_token_id) == (2, 0, 1)
    assert model.inputs_bidirectional_attention is False
    params = restore_checkpoint(out / "checkpoint_0", None)[0]["params"]

    new = 10
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, 96, n).tolist() for n in (1, 3, 5, 2, 4, 6)]
    length = 6 + 1 + new
    rows = [[1, *p] for p in prompts]  # BOS = decoder_start_token_id = 1
    dec_in = np.array([r + [0] * (length - len(r)) for r in rows], np.int32)
    causal = np.array([[1] * len(r) + [0] * (length - len(r)) for r in rows], np.int32)
    batch = {"decoder_input_tokens": dec_in, "decoder_causal_attention": causal}
    got = np.asarray(jax.jit(lambda p, b: model.predict_batch(p, b, max_decode_length=new))(
        params, batch))  # fmt: skip
    want = []
    for r in rows:  # HF with its own generation config: eos 2
        with torch.no_grad():
            o = hf.generate(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=int),
                            max_new_tokens=new, do_sample=False, num_beams=1)  # fmt: skip
        cont = o[0, len(r) :].tolist()
        want.append(cont + [0] * (new - len(cont)))
    np.testing.assert_array_equal(got, np.array(want))
    assert (got == 2).any() and (got == 1).any()  # stopped at 2, went on after a 1

    exported = tmp_path / "exported"
    convert.t5lite_to_hf(out / "checkpoint_0", exported)
    cfg = json.loads((exported / "config.json").read_text())
    # As imported: the unset pad stays unset (t5lite pads with 0 inside, HF never learns it).
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["pad_token_id"]) == (2, 1, None)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(exported)
    assert reloaded.generation_config.eos_token_id == 2


def _sentencepiece(tmp_path):
    import seqio_lite

    text = tmp_path / "text.txt"
    text.write_text("\n".join(["the quick brown fox jumps over the lazy dog",
                               "translate English to German: that is good",
                               "summarize: owning a dog is good for you",
                               "hello world this is a test"] * 20))  # fmt: skip
    return seqio_lite.train_sentencepiece([text], tmp_path / "sp", vocab_size=50)


def test_t5_import_copies_spiece_model_and_keeps_ids(tmp_path, monkeypatch):
    """spiece.model is copied; model.gin binds it as a SentencePieceVocabulary that encodes as
    HF's T5Tokenizer does; non-default ids go to model.gin and back out."""
    import shutil

    import seqio_lite
    from t5lite.hf import convert

    hf_models.t5_hf(tmp_path, vocab_size=160)
    hf_dir = tmp_path / "hf"
    shutil.copyfile(_sentencepiece(tmp_path), hf_dir / "spiece.model")
    cfg_path = hf_dir / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "eos_token_id": 3}))
    out = tmp_path / "imported"
    convert.hf_to_t5lite(hf_dir, out)
    assert (out / "spiece.model").read_bytes() == (hf_dir / "spiece.model").read_bytes()
    text = (out / "model.gin").read_text()
    assert "EncoderDecoderModel.eos_id = 3" in text
    assert "EncoderDecoderModel.decoder_start_token_id = 0" in text
    assert "HF_VOCABULARY = @hf/seqio_lite.SentencePieceVocabulary()" in text
    gin = _parse_model_gin(out / "model.gin")
    try:
        vocab = gin.query_parameter("%HF_VOCABULARY").scoped_configurable_fn()
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
    finally:
        gin.clear_config()
    assert isinstance(vocab, seqio_lite.SentencePieceVocabulary)
    assert (vocab.model_file, vocab.vocab_size) == (str((out / "spiece.model").resolve()), 150)
    assert (model.eos_id, model.pad_id, model.decoder_start_token_id) == (3, 0, 0)

    # NOTE: transformers converts spiece.model with sentencepiece's protobuf module, whose
    # gencode may be newer than the installed protobuf; its own bundled module parses it too.
    import transformers.convert_slow_tokenizer as cst
    from transformers.utils import sentencepiece_model_pb2_new

    monkeypatch.setattr(
        cst, "import_protobuf", lambda error_message="": sentencepiece_model_pb2_new
    )
    tok = transformers.T5Tokenizer.from_pretrained(hf_dir)
    for s in ["the lazy fox is good", "translate: a dog <extra_id_0> over <extra_id_99>"]:
        assert vocab.encode(s) == tok.encode(s, add_special_tokens=False), s
    assert len(tok) == vocab.vocab_size

    exported = tmp_path / "exported"
    convert.t5lite_to_hf(out / "checkpoint_0", exported)
    cfg = json.loads((exported / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["pad_token_id"], cfg["decoder_start_token_id"]) == (3, 0, 0)


def test_export_writes_the_imported_hf_ids_back_as_they_were():
    """An unset pad and a list of EOS ids survive import -> export while the model's ids are
    the imported ones; ids changed since (in gin) are written as the model has them."""
    from t5lite.hf import tokens

    llama3 = {"pad_token_id": None, "eos_token_id": [128001, 128009], "bos_token_id": 128000,
              "decoder_start_token_id": None}  # fmt: skip
    ids, _ = tokens.model_ids(llama3, encoder_decoder=False)
    assert ids == tokens.ModelIds(pad_id=0, eos_id=128001, decoder_start_token_id=128000)
    assert tokens.hf_config_ids(ids, False, llama3) == {
        "pad_token_id": None, "eos_token_id": [128001, 128009], "bos_token_id": 128000}  # fmt: skip
    changed = dataclasses.replace(ids, eos_id=128009)
    assert tokens.hf_config_ids(changed, False, llama3) == {
        "pad_token_id": 0, "eos_token_id": 128009, "bos_token_id": 128000}  # fmt: skip
    assert tokens.hf_config_ids(ids, False) == {
        "pad_token_id": 0, "eos_token_id": 128001, "bos_token_id": 128000}  # fmt: skip
