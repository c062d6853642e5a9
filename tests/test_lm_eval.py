"""t5lite under lm-evaluation-harness, offline, against lm-eval's own `hf` model.

A random small Hugging Face T5 and Llama with a tokenizer trained here (nothing downloaded) are
imported with `t5lite convert`; lm-eval's `hf` model reads the Hugging Face directory, t5lite's
harness model the imported checkpoint and the tokenizer files convert carried beside it. Both
run the shipped local tasks (configs/lm_eval: multiple choice over JSONL, generation over JSONL).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli
from readme_blocks import block

torch = pytest.importorskip("torch", reason="needs the [hf] extra (torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")
pytest.importorskip("lm_eval", reason="needs the [eval] extra (lm-eval)")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs the [eval] extra (accelerate)")

import hf_models  # noqa: E402

from t5lite.hf import convert  # noqa: E402
from t5lite.model import models, network  # noqa: E402
from t5lite.partitioning import Partitioner  # noqa: E402
from t5lite.programs import harness  # noqa: E402
from t5lite.programs.harness_tokens import find_tokens  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = str(ROOT / "configs" / "lm_eval")
# max |loglikelihood_t5lite - loglikelihood_hf| per request, fp32 (sums of a few log-probs;
# the logits agree to ~1e-5, test_hf_parity).
TOL = 1e-4
V = 128


def _tokenizer(path: Path, causal: bool) -> None:
    """A SentencePiece-style BPE trained on the tasks' own text, saved as HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"] if causal else ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = []
    for name in ("mc.jsonl", "gen.jsonl"):
        lines = Path(TASKS, name).read_text().splitlines()
        text += [" ".join(str(v) for v in json.loads(line).values()) for line in lines]
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(text * 4, trainer)
    if causal:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 1)]
        )
        kw = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", special_tokens=[("</s>", 1)]
        )
        kw = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    fast.save_pretrained(path)


def _hf_model(tmp_path: Path, kind: str) -> Path:
    if kind == "t5":
        cfg = hf_models.t5_config(
            vocab_size=V, num_decoder_layers=2, feed_forward_proj="gated-gelu", eos_token_id=1
        )
        model = hf_models.build(transformers.T5ForConditionalGeneration, cfg)
    else:
        cfg = hf_models.llama_config(
            vocab_size=V, max_position_embeddings=256, bos_token_id=1, eos_token_id=2
        )
        model = hf_models.build(transformers.LlamaForCausalLM, cfg)
    hf_dir = tmp_path / f"hf_{kind}"
    model.save_pretrained(hf_dir)
    _tokenizer(hf_dir, causal=kind == "llama")
    return hf_dir


def _t5lite_lm(hf_dir: Path, out: Path, config: harness.HarnessConfig):
    checkpoint = convert.hf_to_t5lite(hf_dir, out)
    model = _model_from(checkpoint)
    partitioner = Partitioner(num_partitions=2)
    params = harness.restore_params(model, partitioner, str(checkpoint), config.batch_size)
    tokens = find_tokens(model, str(checkpoint))
    return model, harness.make_lm(model, partitioner, params, tokens, config)


def _model_from(checkpoint: Path) -> models.BaseModel:
    """The imported model, as convert's model.gin builds it."""
    from t5lite.checkpoint.layout import read_extra
    from t5lite.model.config import config_from_record

    record = read_extra(checkpoint)
    cfg = config_from_record(record["network_config"])
    ids = record["token_ids"]
    if isinstance(cfg, network.T5Config):
        return models.EncoderDecoderModel(cfg, **ids)
    return models.DecoderOnlyModel(cfg, inputs_bidirectional_attention=False, **ids)


def _requests(task_name: str):
    """The task's requests as lm-eval builds them (zero-shot)."""
    from lm_eval.tasks import TaskManager

    prepared = harness.prepare(harness.HarnessConfig(tasks=[task_name], include_path=TASKS))
    (task,) = harness.load_tasks(prepared)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    assert isinstance(prepared.manager, TaskManager)
    return task.instances


@pytest.fixture(scope="module", params=["t5", "llama"])
def imported(request, tmp_path_factory):
    """(kind, HF directory, t5lite harness model) for a random small HF model."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf_dir = _hf_model(tmp, request.param)
    config = harness.HarnessConfig(tasks=[], batch_size=4, max_length=64, max_gen_toks=8)
    _, lm = _t5lite_lm(hf_dir, tmp / "t5lite", config)
    return request.param, hf_dir, lm


def test_loglikelihood_and_greedy_generation_equal_lm_evals_hf_model(imported):
    from lm_eval.models.huggingface import HFLM

    kind, hf_dir, lm = imported
    backend = "seq2seq" if kind == "t5" else "causal"
    ref = HFLM(pretrained=str(hf_dir), backend=backend, device="cpu", batch_size=4, max_length=64)

    mc = _requests("t5lite_mc")
    ours = lm.loglikelihood(mc)
    theirs = ref.loglikelihood(mc)
    assert len(ours) == len(theirs) == 18
    diff = max(abs(a[0] - b[0]) for a, b in zip(ours, theirs))
    assert diff < TOL, diff
    assert [a[1] for a in ours] == [b[1] for b in theirs]

    gen = _requests("t5lite_gen")
    ref_gen = gen
    if kind == "t5":
        # NOTE: lm-eval's hf seq2seq lets the decoder run to len(context) + max_gen_toks
        # tokens; its `max_length` pins it to the task's max_gen_toks (+ the start token).
        ref_gen = [
            dataclasses.replace(r, arguments=(r.args[0], {**r.args[1], "max_length": 9}))
            for r in gen
        ]
    texts = lm.generate_until(gen)
    assert texts == ref.generate_until(ref_gen)
    assert all(texts) and len(set(texts)) > 1  # real continuations, not all the same

    rolling = [type(r)("loglikelihood_rolling", r.doc, (r.args[0],), r.idx) for r in gen]
    got, want = lm.loglikelihood_rolling(rolling), ref.loglikelihood_rolling(rolling)
    np.testing.assert_allclose(got, want, atol=TOL)


def test_multiple_choice_accuracy_is_the_argmax_of_t5lites_scores(imported, tmp_path):
    from t5lite.programs.evaluate import read_eval_results
    from t5lite.programs.metrics_writer import MetricsWriter

    _, _, lm = imported
    config = harness.HarnessConfig(tasks=["t5lite_mc"], include_path=TASKS)
    writer = MetricsWriter(str(tmp_path), total_steps=7)
    metrics = harness.run_harness(lm, config, harness.prepare(config), writer=writer, step=7)
    writer.close()
    requests = _requests("t5lite_mc")
    scores = [logp for logp, _ in lm.loglikelihood(requests)]
    docs = [json.loads(line) for line in Path(TASKS, "mc.jsonl").read_text().splitlines()]
    picks = [int(np.argmax(scores[3 * i : 3 * i + 3])) for i in range(len(docs))]
    assert [r.doc["answer"] for r in requests[::3]] == [d["answer"] for d in docs]
    want = float(np.mean([p == d["answer"] for p, d in zip(picks, docs)]))
    assert metrics == {"t5lite_mc/acc": want}
    (record,) = read_eval_results(tmp_path, "t5lite_mc", "test")
    assert (record["step"], record["metrics"]) == (7, {"acc": want})
    assert record["harness"].startswith("lm-eval 0.4.")


# --- the CLI and the docs ---------------------------------------------------------------------


def _run_commands(text: str) -> None:
    """Runs a docs block's `t5lite ...` commands in this process (shared compile cache)."""
    for line in text.replace("\\\n", " ").splitlines():
        argv = shlex.split(line)
        assert argv[0] == "t5lite", line
        assert run_cli(*argv[1:]) == 0, line


def _records(model_dir: str, task: str) -> list[dict]:
    from t5lite.programs.evaluate import read_eval_results

    return read_eval_results(model_dir, task, "test")


def test_docs_import_and_eval_and_the_registered_lm_eval_model(tmp_path):
    hf_dir = Path("/tmp/t5lite_lmeval_hf")
    for d in (hf_dir, Path("/tmp/t5lite_lmeval_llama")):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(_hf_model(tmp_path, "llama"), hf_dir)
    _run_commands(block("docs/lm-eval.md", "import-and-eval"))
    (mc,) = _records("/tmp/t5lite_lmeval_llama", "t5lite_mc")
    (gen,) = _records("/tmp/t5lite_lmeval_llama", "t5lite_gen")
    assert (mc["step"], gen["step"], set(gen["metrics"])) == (0, 0, {"exact_match"})
    # lm-eval's own loop over the registered `t5lite` model gives the same accuracy.
    import gin

    scope: dict = {}
    try:
        exec(block("docs/lm-eval.md", "simple-evaluate"), scope)
    finally:
        with gin.unlock_config():
            gin.clear_config()
    assert scope["results"]["results"]["t5lite_mc"]["acc,none"] == mc["metrics"]["acc"]


def test_training_runs_the_tasks_and_eval_writes_the_same_numbers():
    """The records of step 1 written during training (2 x 4 mesh, parameters in memory) and by
    `t5lite eval` of checkpoint 1 (8 x 1 mesh, restored)."""
    run = "/tmp/t5lite_lmeval_run"
    shutil.rmtree(run, ignore_errors=True)
    _run_commands(block("docs/lm-eval.md", "train-with-harness"))
    during = {t: _records(run, t) for t in ("t5lite_mc", "t5lite_ppl")}
    assert [r["step"] for r in during["t5lite_ppl"]] == [1, 2]
    _run_commands(block("docs/lm-eval.md", "eval-run"))
    for task, records in during.items():
        (after,) = _records(run, task)[2:]
        assert after["step"] == 1
        assert after["metrics"].keys() == records[0]["metrics"].keys()
        for k, v in records[0]["metrics"].items():
            # NOTE: another mesh sums in another order: float32 rounding, nothing more.
            assert after["metrics"][k] == pytest.approx(v, rel=1e-5), (task, k)
    bpb = during["t5lite_ppl"][0]["metrics"]["bits_per_byte"]
    assert 1 < bpb < 16  # an untrained byte model: a few bits per byte
    logged = [json.loads(line) for line in Path(run, "metrics.jsonl").read_text().splitlines()]
    acc = [m for m in logged if "t5lite_mc/acc" in json.dumps(m)]
    assert len(acc) == 3, acc  # steps 1, 2 in training; step 1 again by eval


@pytest.mark.parametrize(
    "task, yaml, message",
    [
        (
            "hellaswag",
            None,
            "harness task 'hellaswag' is not defined in {d}; lm-eval's built-in tasks "
            "download their data from the Hugging Face hub",
        ),
        (
            "hub_task",
            "task: hub_task\ndataset_path: Rowan/hellaswag\noutput_type: multiple_choice\n"
            "doc_to_text: x\ndoc_to_target: 0\ndoc_to_choice: [a]\ntest_split: test\n",
            "harness task 'hub_task' needs the network: dataset_path 'Rowan/hellaswag' "
            "({d}/t.yaml) is a Hugging Face hub dataset",
        ),
        (
            "nofile_task",
            "task: nofile_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            "    test: missing.jsonl\noutput_type: multiple_choice\ndoc_to_text: x\n"
            "doc_to_target: 0\ndoc_to_choice: [a]\ntest_split: test\n",
            "harness task 'nofile_task': data file {d}/missing.jsonl does not exist ({d}/t.yaml)",
        ),
        (
            "beam_task",
            "task: beam_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            "    test: gen.jsonl\noutput_type: generate_until\ndoc_to_text: x\n"
            "doc_to_target: y\ntest_split: test\ngeneration_kwargs:\n  num_beams: 4\n",
            "harness task 'beam_task' ({d}/t.yaml): generation_kwargs num_beams=4: t5lite's "
            "harness model cannot honour it",
        ),
    ],
)
def test_tasks_that_cannot_run_offline_are_one_line_naming_them(
    tmp_path, capsys, task, yaml, message
):
    d = tmp_path / "tasks"
    d.mkdir()
    if yaml:
        (d / "t.yaml").write_text(yaml)
    rc = run_cli(
        "eval",
        "--gin_file=runs/lm_eval.gin",
        f"--gin.MODEL_DIR='{tmp_path}/none'",
        "--gin.MODEL=@DecoderOnlyModel()",
        f"--gin.HARNESS_TASKS=['{task}']",
        f"--gin.HARNESS_INCLUDE_PATH='{d}'",
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("t5lite eval: error: " + message.format(d=d)), err


# --- a t5lite model with its own vocabulary -----------------------------------------------------


@pytest.mark.parametrize("converter", ["lm", "prefix_lm"])
def test_own_vocabulary_scores_equal_the_seqio_score_path(converter):
    """A t5lite decoder-only model with a byte vocabulary: `loglikelihood` equals `score_batch`
    on the rows seqio_lite's prefix-LM feature converter builds from (context, continuation)
    (BOS in front, loss on the continuation; a prefix-LM's context attends bidirectionally)."""
    from lm_eval.api.instance import Instance

    import seqio_lite
    from seqio_lite import feature_converters as fc
    from t5lite.programs.harness_tokens import Tokens
    from t5lite.trainer import Trainer

    cfg = network.DecoderOnlyConfig(
        vocab_size=384,
        emb_dim=16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        mlp_dim=32,
        num_layers=2,
    )
    model = models.DecoderOnlyModel(cfg, feature_converter=converter)
    partitioner = Partitioner(num_partitions=2)
    lengths = {"inputs": 32, "targets": 16}
    pairs = [("The sky is", " blue"), ("Two plus two", " is four"), ("A cat", " says meow")]
    vocab = seqio_lite.ByteVocabulary()
    conv = fc.PrefixLMFeatureConverter(pack=False, bos_id=model.decoder_start_token_id)
    rows = [
        [
            conv.convert_example(
                {"inputs": vocab.encode_np(c), "targets": vocab.encode_np(k)}, lengths
            )
        ]
        for c, k in pairs
    ]
    batch = conv.make_batch(rows, 4, conv.group_lengths(lengths))
    ref_lengths = {"targets": 48} if converter == "lm" else lengths
    trainer = Trainer(model, partitioner, batch_size=4, lengths=ref_lengths, seed=3)
    params = trainer.init_state().params
    want = trainer.score_fn(params)(batch)[: len(pairs)]

    tokens = Tokens(vocab, model.eos_id, model.decoder_start_token_id, "bos")
    config = harness.HarnessConfig(tasks=[], batch_size=4, max_length=64)
    lm = harness.make_lm(model, partitioner, params, tokens, config)
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = [logp for logp, _ in lm.loglikelihood(requests)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- sampled generation -------------------------------------------------------------------------

# A hot setting on a random model: samples of different seeds cannot all agree.
SAMPLED = {"do_sample": True, "temperature": 2.0, "top_k": 40, "top_p": 0.95}


def _with_kwargs(requests, **kwargs):
    """The requests twice over (2 batches of 4), each with `kwargs` added to its own."""
    return [
        dataclasses.replace(r, arguments=(r.args[0], {**r.args[1], **kwargs}), idx=i)
        for i, r in enumerate(requests + requests)
    ]


def _reference_samples(lm, requests, seed: int) -> list[str]:
    """t5lite's `decoding.temperature_sample` on the harness's batches (longest prompts first,
    batch k sampling with fold_in(PRNGKey(seed), k)), its logits recomputed without a KV cache:
    the whole row so far, teacher-forced through `_logits`."""
    import jax
    import jax.numpy as jnp

    from t5lite.model import decoding

    model, n, kw = lm.model, lm.batch_size, requests[0].args[1]
    until, max_gen = list(kw["until"]), kw["max_gen_toks"]
    causal = lm.backend == "causal"
    prompts = [lm.tok_encode(r.args[0]) for r in requests]
    if causal:
        bos = model.decoder_start_token_id
        prompts = [p if p[:1] == [bos] else [bos, *p] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

    def tokens_to_logits(state):
        """The logits at `cur_index` of the rows so far; the "cache" is the encoder input."""
        start = jnp.full((n, 1), model.decoder_start_token_id, jnp.int32)
        inputs = jnp.concatenate([start, state.sequences[:, :-1]], axis=1)
        batch = {"decoder_input_tokens": inputs, "decoder_target_tokens": jnp.ones_like(inputs)}
        if not causal:
            batch["encoder_input_tokens"] = state.cache
        logits_BLV = model._logits(lm.params, batch, None)
        return logits_BLV[jnp.arange(n), state.cur_index], state.cache

    out = [""] * len(prompts)
    for k in range(0, len(order), n):
        chunk = order[k : k + n]
        longest = max(len(prompts[i]) for i in chunk)
        # The harness's row lengths (powers of two >= 16): padding is masked either way, but the
        # same shapes keep the float sums in the same order.
        width = max(16, 1 << (longest + (max_gen if causal else 0) - 1).bit_length())
        rows = np.zeros((n, width), np.int32)
        for b, i in enumerate(chunk):
            rows[b, : len(prompts[i])] = prompts[i]
        dec_len = width if causal else 16
        if causal:
            prompt_BL = jnp.where(jnp.asarray(rows) > 0, jnp.asarray(rows), model.pad_id)
            prompt_BL = prompt_BL.at[:, 0].set(model.decoder_start_token_id)
            initial = jnp.asarray(
                [max(len(prompts[i]) - 1, 0) for i in chunk] + [0] * (n - len(chunk))
            )
        else:
            prompt_BL, initial = jnp.full((n, dec_len), model.pad_id, jnp.int32), None
        sequences, _ = decoding.temperature_sample(
            prompt_BL,
            jnp.asarray(rows),
            tokens_to_logits,
            decode_rng=jax.random.fold_in(jax.random.PRNGKey(seed), k // n),
            initial_index=initial,
            temperature=kw["temperature"],
            top_k=kw["top_k"],
            top_p=kw["top_p"],
            max_decode_steps=max_gen,
            eos_id=model.eos_id,
            pad_id=model.pad_id,
            decoder_start_token_id=model.decoder_start_token_id,
        )
        for b, i in enumerate(chunk):
            first = len(prompts[i]) - 1 if causal else 0
            ids = []
            for t in np.asarray(sequences[b, 0, first : first + max_gen]).tolist():
                if t == model.pad_id:
                    break
                ids.append(t)
                if t == model.eos_id:
                    break
            text = lm.tok_decode(ids)
            for term in until:
                text = text.split(term)[0]
            out[i] = text
    return out


def test_sampling_is_t5lites_temperature_sample_with_the_seed(imported):
    from t5lite.programs.harness_lm import T5LiteLM

    _, _, lm = imported
    gen = _requests("t5lite_gen")
    sampled = _with_kwargs(gen, **SAMPLED)

    def seeded(seed: int) -> T5LiteLM:
        return T5LiteLM(
            lm.model,
            lm.params,
            lm.tokens,
            partitioner=lm.partitioner,
            batch_size=lm.batch_size,
            max_length=lm.max_length,
            max_gen_toks=lm.max_gen_toks,
            seed=seed,
        )

    lm7 = seeded(7)
    texts = lm7.generate_until(sampled)
    assert all(texts)  # real samples (the hot setting seldom stops early)
    assert texts == _reference_samples(lm, sampled, seed=7)
    assert lm7.generate_until(sampled) == texts  # every call starts from the seed
    assert texts[:4] != texts[4:]  # a repeated prompt is sampled anew
    assert seeded(8).generate_until(sampled) != texts
    # top_k=1 keeps the argmax alone: greedy decoding, whatever the temperature.
    top1 = _with_kwargs(gen, do_sample=True, temperature=5.0, top_k=1)
    assert lm7.generate_until(top1) == lm.generate_until(gen + gen)


_HONOURED = (
    "until, max_gen_toks, do_sample, temperature, top_k, top_p and the aliases of max_gen_toks"
)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"num_beams": 4},
            f"generation_kwargs num_beams=4: t5lite's harness model cannot honour it (it decodes "
            f"{_HONOURED})",
        ),
        (
            {"do_sample": True, "temperature": 0.7, "min_p": 0.1},
            f"generation_kwargs min_p=0.1: t5lite's harness model cannot honour it (it decodes "
            f"{_HONOURED})",
        ),
        (
            {"do_sample": True},
            "generation_kwargs temperature=0.0 with do_sample=True: sampling needs a temperature "
            "> 0 (lm-eval's hf model refuses it too); do_sample: false is greedy",
        ),
        (
            {"do_sample": True, "temperature": 0.7, "top_k": -1},
            "generation_kwargs top_k=-1: must be an integer >= 0 (0: all)",
        ),
        (
            {"do_sample": True, "temperature": 0.7, "top_p": 1.5},
            "generation_kwargs top_p=1.5: must be in [0, 1]",
        ),
    ],
)
def test_generation_kwargs_t5lite_cannot_honour_are_one_line_naming_them(kwargs, message):
    """Checked for every group of requests before any is generated (no parameters here)."""
    from lm_eval.api.instance import Instance

    import seqio_lite
    from t5lite.programs.harness_lm import T5LiteLM
    from t5lite.programs.harness_tokens import Tokens

    cfg = network.DecoderOnlyConfig(vocab_size=384, emb_dim=8, num_heads=2, head_dim=4, mlp_dim=8)
    model = models.DecoderOnlyModel(cfg)
    tokens = Tokens(seqio_lite.ByteVocabulary(), model.eos_id, model.decoder_start_token_id, "bos")
    lm = T5LiteLM(model, None, tokens, partitioner=Partitioner(num_partitions=1))
    requests = [
        Instance("generate_until", {}, ("Q", {"until": ["\n"], "do_sample": False}), 0),
        Instance("generate_until", {}, ("Q", {"until": ["\n"], **kwargs}), 1),
    ]
    with pytest.raises(ValueError) as e:
        lm.generate_until(requests)
    assert str(e.value) == message
