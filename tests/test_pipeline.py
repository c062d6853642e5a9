"""Pipeline parallelism (model/pipeline.py): a pipelined step equals the unpipelined one, the
stage-to-stage permutes match the analytic schedule, and bad input is refused in one line."""

import functools
import io
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import require_devices, run_cli

from t5lite import collectives, partitioning
from t5lite.insight import pipeline as insight_pipeline
from t5lite.model import network, optimizers, pipeline
from t5lite.model.models import DecoderOnlyModel
from t5lite.trainer import Trainer, summarize

LM = dict(
    vocab_size=32, emb_dim=16, num_heads=2, num_layers=4, head_dim=8, mlp_dim=32, scan_layers=True
)
LENGTHS = {"targets": 8}
BATCH = 16


def _batch(seed: int = 0) -> dict:
    """A packed LM batch: two segments per row, the last positions padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 32, (BATCH, 8)).astype(np.int32)
    segments = np.repeat(np.array([[1, 1, 1, 2, 2, 2, 0, 0]], np.int32), BATCH, 0)
    positions = np.array([[0, 1, 2, 0, 1, 2, 0, 0]], np.int32).repeat(BATCH, 0)
    targets = np.where(segments > 0, tokens, 0)
    inputs = np.where(positions > 0, np.roll(targets, 1, 1), 0)
    return {
        "decoder_input_tokens": inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": (segments > 0).astype(np.float32),
        "decoder_segment_ids": segments,
        "decoder_positions": positions,
    }


@functools.cache
def _rules(base: str, stages: int):
    """`base`'s table, with `layers` -> stage when there are stages."""
    return partitioning.pipeline_rules(base) if stages > 1 else partitioning.preset_rules(base)


@functools.cache
def _trainer(
    base: str,
    stages: int,
    num_partitions: int,
    microbatches: int = 4,
    schedule: str = "gpipe",
    remat: str = "none",
) -> Trainer:
    require_devices(8)
    cfg = network.DecoderOnlyConfig(
        **LM, pipeline_microbatches=microbatches, pipeline_schedule=schedule, remat_policy=remat
    )
    part = partitioning.Partitioner(
        num_partitions=num_partitions, num_stages=stages, logical_axis_rules=_rules(base, stages)
    )
    model = DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-2))
    return Trainer(model, part, batch_size=BATCH, lengths=LENGTHS)


def _run(tr: Trainer, steps: int = 3):
    state = tr.init_state()
    batch = tr.global_batch(_batch())
    with tr.partitioner.context():
        grads, _ = jax.jit(tr._grads)(state.params, batch, jax.random.PRNGKey(0))
    losses = []
    for _ in range(steps):
        state, metrics = tr.train_step(state, batch)
        losses.append(summarize(metrics)["loss"])
    return losses, grads, state


@pytest.mark.parametrize("base, stages, num_partitions", [("megatron", 2, 2), ("fsdp", 4, 1)])
def test_gpipe_equals_unpipelined(base, stages, num_partitions):
    """stage=2 x data=2 x model=2 (Megatron) and stage=4 x data=2 (FSDP): three Adam steps give
    the unpipelined losses and parameters, and the first step's gradients, to fp32 rounding."""
    pp = _trainer(base, stages, num_partitions)
    ref = _trainer(base, 1, num_partitions)
    assert pp.partitioner.mesh.shape["stage"] == stages
    losses, grads, state = _run(pp)
    ref_losses, ref_grads, ref_state = _run(ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-6)
    for p, r in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)
    ):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=5e-5)
    # Each stage holds its layers (and their Adam moments): `layers` -> stage.
    wi = state.params["decoder"]["layers"]["mlp"]["wi_0"]["kernel"]
    assert wi.sharding.spec[0] == "stage"
    assert wi.addressable_shards[0].data.shape[0] == LM["num_layers"] // stages


def test_stack_strategy_is_pipeline():
    tr = _trainer("megatron", 2, 2)
    with tr.partitioner.context():
        choice = pipeline.select(4, "DecoderOnlyConfig.num_layers")
        assert pipeline.split_size("batch") == 2 and pipeline.stage_axes() == ("stage",)
    assert choice == collectives.Choice(
        collectives.Strategy.PIPELINE, pipeline.PipelinePlan(("stage",), 2)
    )
    fsdp = partitioning.preset_rules("fsdp")
    want = tuple((n, "stage" if n == "layers" else a) for n, a in fsdp)
    assert partitioning.pipeline_rules("fsdp") == want and ("layers", None) in fsdp


def _lower(base: str = "megatron", stages: int = 2, rules=None, **overrides) -> None:
    """Builds a trainer and traces (never compiles) its train step."""
    require_devices(8)
    cfg = network.DecoderOnlyConfig(**{**LM, **overrides})
    part = partitioning.Partitioner(
        num_partitions=1, num_stages=stages, logical_axis_rules=rules or _rules(base, stages)
    )
    model = DecoderOnlyModel(cfg, optimizer=optimizers.AdamW(1e-2))
    tr = Trainer(model, part, batch_size=BATCH, lengths=LENGTHS)
    tr.train_step.lower(tr.abstract_state(), tr.batch_abstract)


@pytest.mark.parametrize(
    "overrides, error, text",
    [
        (
            dict(num_layers=3),
            partitioning.PartitioningError,
            "parameter 'params/decoder/layers/mlp/wi_0/kernel', shape (3, 16, 32), logical axes "
            "('layers', 'embed', 'mlp'), mesh {stage: 2, data: 4, model: 1}: dimension 0 of size "
            "3 is not divisible by mesh axes 'stage' of size 2",
        ),
        (
            dict(scan_layers=False),
            ValueError,
            "DecoderOnlyConfig.scan_layers=False, but the rules split 'layers' over mesh axes "
            "('stage',) (pipeline stages): set scan_layers=True",
        ),
        (
            dict(pipeline_microbatches=3),
            ValueError,
            "DecoderOnlyConfig.pipeline_microbatches=3: a batch of 16 rows does not cut into 3 "
            "microbatches that divide over the 4 devices splitting the batch (needs a multiple "
            "of 12 rows)",
        ),
        (
            dict(pipeline_schedule="zero_bubble"),
            ValueError,
            "DecoderOnlyConfig.pipeline_schedule must be one of ('gpipe', '1f1b'), got "
            "'zero_bubble'",
        ),
        (
            dict(pipeline_schedule="1f1b", pipeline_microbatches=1),
            ValueError,
            "DecoderOnlyConfig.pipeline_microbatches=1: schedule '1f1b' needs at least as many "
            "microbatches as the 2 pipeline stages",
        ),
        (
            dict(rules=partitioning.preset_rules("fsdp")),
            partitioning.PartitioningError,
            "mesh {stage: 2, data: 4, model: 1} has a 'stage' axis that no rule names, so its 2 "
            "stages would hold copies: use Partitioner.logical_axis_rules = @pipeline_rules()",
        ),
    ],
)
def test_bad_input_is_one_line(overrides, error, text):
    with pytest.raises(error) as e:
        _lower(**overrides)
    assert str(e.value) == text


def test_an_unscanned_pipeline_from_gin_writes_nothing(tmp_path, capsys):
    """The docs' pipelined LM with its layers unscanned: refused when the trainer is built,
    before the metrics writer or anything else touches the model directory."""
    require_devices(8)
    model_dir = tmp_path / "run"
    gin = ["--gin_file=examples/pipeline_lm.gin", f"--gin.MODEL_DIR='{model_dir}'"]
    assert run_cli("train", *gin, "--gin.SCAN_LAYERS=False") == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "t5lite train: error: DecoderOnlyConfig.scan_layers=False, but the rules split 'layers' "
        "over mesh axes ('stage',) (pipeline stages): set scan_layers=True"
    ]
    assert not model_dir.exists()


def test_explicit_axes_refuse_stages():
    require_devices(8)
    with pytest.raises(partitioning.PartitioningError) as e:
        partitioning.Partitioner(
            num_stages=2, shard_mode="explicit", logical_axis_rules=_rules("megatron", 2)
        )
    assert str(e.value) == "Partitioner.num_stages=2: pipeline stages need shard_mode='auto'"


def test_checkpoints_restore_across_pipelined_and_unpipelined_meshes(tmp_path):
    """The on-disk layout is the scanned tree whatever the mesh: a state saved with stages
    restores bit for bit without them (and back), laid out by the restoring trainer."""
    from t5lite.checkpoint import CheckpointManager

    pp, ref = _trainer("megatron", 2, 2), _trainer("megatron", 1, 2)
    state, _ = pp.train_step(pp.init_state(), pp.global_batch(_batch()))
    saved = jax.tree_util.tree_map(np.asarray, state)
    with CheckpointManager(tmp_path / "a", async_save=False) as mgr:
        mgr.save(1, state)
        restored, _ = mgr.restore(ref.abstract_state())
    for r, s, want in zip(
        jax.tree_util.tree_leaves(restored),
        jax.tree_util.tree_leaves(saved),
        jax.tree_util.tree_leaves(ref.state_shardings),
    ):
        np.testing.assert_array_equal(np.asarray(r), s)
        assert r.sharding == want
    state, _ = ref.train_step(restored, ref.global_batch(_batch(1)))
    saved = jax.tree_util.tree_map(np.asarray, state)
    with CheckpointManager(tmp_path / "b", async_save=False) as mgr:
        mgr.save(2, state)
        back, _ = mgr.restore(pp.abstract_state())
    for r, s in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(saved)):
        np.testing.assert_array_equal(np.asarray(r), s)
    assert back.params["decoder"]["layers"]["mlp"]["wo"]["kernel"].sharding.spec[0] == "stage"


def test_compiled_permutes_and_bubble_equal_the_analytic_schedule():
    """stage=2, m=4: 5 ticks a pass, one collective-permute of a microbatch's activations per
    tick each way (16 rows / 4 microbatches / data=2 = 2 rows x 8 positions x 16 x 4 bytes)."""
    tr = _trainer("megatron", 2, 2)
    with tr.partitioner.context():
        hlo = tr.train_step.lower(tr.abstract_state(), tr.batch_abstract).compile().as_text()
    f = insight_pipeline.pipeline_figures(tr, hlo)
    assert (f.stages, f.microbatches, f.ticks) == (2, 4, 5)
    assert f.bubble == pytest.approx(1 / 5)
    assert f.permute_bytes == (2 * 8 * 16 * 4,)
    assert (f.compiled_ticks, f.compiled_bubble) == (5, pytest.approx(1 / 5))
    assert f.compiled_permutes == f.permutes == 10
    assert f.compiled_permute_bytes == f.permute_bytes_total == 10 * 1024
    assert "bubble: analytic (p-1)/(m+p-1) = 20.0%; compiled schedule (5 ticks) 20.0%" in f.format()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_t5_encoder_and_decoder_are_each_pipelined(schedule):
    """T5's two stacks each run as a pipeline over the same stages (the decoder's microbatches
    read their rows of the encoder's output; under 1F1B the encoder output's and the relative
    position bias's gradients come out of the decoder's schedule): two steps equal the
    unpipelined ones."""
    from conftest import reverse_batch

    from t5lite.model.models import EncoderDecoderModel

    cfg = network.T5Config(
        vocab_size=32,
        emb_dim=16,
        num_heads=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        head_dim=8,
        mlp_dim=32,
        scan_layers=True,
        pipeline_microbatches=4,
        pipeline_schedule=schedule,
    )
    runs = []
    for stages in (1, 2):
        part = partitioning.Partitioner(
            num_partitions=2, num_stages=stages, logical_axis_rules=_rules("megatron", stages)
        )
        model = EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-2))
        tr = Trainer(model, part, batch_size=BATCH, lengths={"inputs": 8, "targets": 8})
        state, losses = tr.init_state(), []
        for _ in range(2):
            state, metrics = tr.train_step(state, tr.global_batch(reverse_batch(BATCH)))
            losses.append(summarize(metrics)["loss"])
        runs.append((losses, jax.tree_util.tree_leaves(state.params)))
    (ref_losses, ref_params), (losses, params) = runs
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for p, r in zip(params, ref_params):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=5e-5)


def test_docs_pipeline_train():
    """docs/pipeline.md's train command as written: 20 pipelined steps (stage=2 x data=4, GPipe
    over 4 microbatches) run through the CLI, the loss falls and the last checkpoint is written."""
    import json

    from readme_blocks import block, run

    model_dir = Path("/tmp/t5lite_pipeline")  # MODEL_DIR of configs/examples/pipeline_lm.gin
    shutil.rmtree(model_dir, ignore_errors=True)
    run(block("docs/pipeline.md", "pipeline-train"), timeout=600)
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["split"] == "train"]
    assert [r["step"] for r in train][-1] == 20
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, (train[0], train[-1])
    assert (model_dir / "checkpoint_20").is_dir()


def test_docs_pipeline_inspect():
    """docs/pipeline.md's inspect command as written: gin alone shows the bubble and the
    permutes, analytic beside compiled."""
    from readme_blocks import block, run

    out = run(block("docs/pipeline.md", "pipeline-inspect"), timeout=600)
    assert "bubble: analytic (p-1)/(m+p-1) = 20.0%; compiled schedule (5 ticks) 20.0%" in out.stdout
    assert "stage-to-stage permutes per step: analytic 10 x" in out.stdout


@pytest.mark.parametrize("base, stages, num_partitions", [("megatron", 2, 2), ("fsdp", 4, 1)])
def test_stage_row_of_the_communication_table_agrees(base, stages, num_partitions):
    """The analytic communication counts the pipeline's collectives over `stage` (T = m + p - 1
    ticks, a = one microbatch's 1 KiB): 2T schedule permutes, the input's gradient all-reduced
    once after the backward ticks (m = 4 microbatches) and the output's hand-off; `inspect`'s
    stage row agrees with the compiled step (within 10%)."""
    from t5lite.insight.comparison import compare_communication
    from t5lite.insight.report import compile_train_step, step_report

    tr = _trainer(base, stages, num_partitions)
    step = step_report(tr, compiled=compile_train_step(tr))
    mine = [e for e in step.analytic.expected if e.axes == ("stage",)]
    t, a = 4 + stages - 1, 1024
    assert [(e.kind, e.count, e.bytes) for e in mine] == [
        ("collective-permute", 2 * t, 2 * t * a),
        ("all-reduce", 1, 4 * a),
        ("collective-permute", 2, (t + 4) * a),
        ("all-reduce", 1, 4 * a),
    ]
    (row,) = [
        c for c in compare_communication(step.collectives, step.analytic) if c.axes == ("stage",)
    ]
    assert row.agrees, row


@pytest.mark.parametrize(
    "base, stages, num_partitions, microbatches, remat",
    [
        ("megatron", 2, 2, 4, "none"),
        ("fsdp", 4, 1, 4, "none"),
        ("fsdp", 2, 1, 4, "none"),
        ("megatron", 2, 2, 4, "minimal"),
        ("fsdp", 4, 1, 4, "minimal"),
        ("fsdp", 4, 1, 4, "full"),
        ("megatron", 2, 2, 4, "full"),
    ],
)
def test_memory_with_microbatches_in_flight_within_10_percent(
    base, stages, num_partitions, microbatches, remat
):
    """GPipe's analytic peak per device (every tick's residuals of the stage's layers live, at
    one microbatch each, under the remat policy) is within 10% of XLA's memory analysis of the
    compiled step."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step

    tr = _trainer(base, stages, num_partitions, microbatches, remat=remat)
    compiled = memory_report(compile_train_step(tr)).total
    pm = insight_pipeline.pipeline_memory(tr)
    ticks = microbatches + stages - 1
    (a,) = insight_pipeline.pipeline_figures(tr).permute_bytes  # one microbatch's [b, L, D]
    assert pm.stack_buffers == (2 * microbatches + ticks) * a
    if remat == "none":
        assert pm.in_flight > 0.6 * (pm.total - pm.state - pm.gradients)
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)
    assert f"compiled {compiled / 1024:.2f} KiB" in pm.format(compiled)


@functools.cache
def _t5_trainer(base: str, stages: int, num_partitions: int, remat: str, schedule: str) -> Trainer:
    """T5 with 4 + 4 scanned layers, 4 microbatches, `stages` stages of each stack."""
    from t5lite.model.models import EncoderDecoderModel

    require_devices(8)
    cfg = network.T5Config(
        vocab_size=32,
        emb_dim=16,
        num_heads=2,
        num_encoder_layers=4,
        num_decoder_layers=4,
        head_dim=8,
        mlp_dim=32,
        scan_layers=True,
        pipeline_microbatches=4,
        pipeline_schedule=schedule,
        remat_policy=remat,
    )
    part = partitioning.Partitioner(
        num_partitions=num_partitions,
        num_stages=stages,
        logical_axis_rules=_rules(base, stages),
    )
    model = EncoderDecoderModel(cfg, optimizer=optimizers.AdamW(1e-2))
    return Trainer(model, part, batch_size=BATCH, lengths={"inputs": 8, "targets": 8})


@pytest.mark.parametrize(
    "base, stages, num_partitions, remat, schedule",
    [
        ("fsdp", 4, 1, "none", "gpipe"),
        ("fsdp", 4, 1, "minimal", "gpipe"),
        ("fsdp", 4, 1, "full", "gpipe"),
        ("megatron", 2, 2, "none", "gpipe"),
        ("megatron", 2, 2, "minimal", "gpipe"),
        ("megatron", 2, 2, "full", "gpipe"),
    ],
)
def test_t5_memory_within_10_percent(base, stages, num_partitions, remat, schedule):
    """T5's two pipelined stacks (4 + 4 layers, 4 microbatches): the schedule's analytic peak
    per device is within 10% of XLA's memory analysis of the compiled step. The decoder's
    buffers include the encoder output it reads (GPipe: stashed for each of the T ticks, 1F1B:
    its m microbatches) and that output's gradient (m microbatches)."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step

    tr = _t5_trainer(base, stages, num_partitions, remat, schedule)
    compiled = memory_report(compile_train_step(tr)).total
    pm = insight_pipeline.pipeline_memory(tr)
    enc, dec = insight_pipeline.pipeline_figures(tr).permute_bytes
    m, t = 4, 4 + stages - 1
    if schedule == "gpipe":
        assert pm.stack_buffers == (2 * m + t) * (enc + dec) + (t + m) * enc
    else:
        assert pm.stack_buffers == 3 * m * (enc + dec) + 2 * m * enc
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)


def _plan_lm_fsdp(**kwargs) -> tuple[list, io.StringIO]:
    """`plan` of the test LM over the fsdp preset without remat on 8 devices, its best layout
    compiled; `kwargs` add the stage counts, schedules, model sizes (or set `top_k`)."""
    from t5lite.insight.plan import plan

    model = DecoderOnlyModel(network.DecoderOnlyConfig(**LM), optimizer=optimizers.AdamW(1e-2))
    out = io.StringIO()
    ranked = plan(
        model=model,
        task_feature_lengths=LENGTHS,
        batch_size=BATCH,
        num_devices=8,
        presets=["fsdp"],
        remat_policies=["none"],
        stream=out,
        progress=io.StringIO(),
        **{"top_k": 1, **kwargs},
    )
    return ranked, out


def test_plan_searches_stage_counts_and_ranks_them():
    """`plan` with stage counts 1, 2, 4 on 8 devices: GPipe layouts beside the others, screened
    with the pipeline's memory, ranked with them, and the verdict names the best of each kind."""

    from t5lite.insight.plan import enumerate_layouts

    require_devices(8)
    layouts = enumerate_layouts(8, ["fsdp"], ["none"], stage_counts=(1, 2, 4), batch_size=BATCH)
    # per stage: data x model over 8 / p devices; m = 4p when the batch cuts so over data, else p
    assert [(x.stages, x.data, x.model, x.microbatches) for x in layouts] == [
        (1, 8, 1, 0),
        (1, 4, 2, 0),
        (1, 2, 4, 0),
        (1, 1, 8, 0),
        (2, 4, 1, 2),
        (2, 2, 2, 8),
        (2, 1, 4, 8),
        (4, 2, 1, 4),
        (4, 1, 2, 16),
    ]
    ranked, out = _plan_lm_fsdp(stage_counts=(1, 2, 4))
    valid = [c for c in ranked if c.predicted is not None]
    assert {c.layout.stages for c in valid} == {1, 2, 4}
    for c in valid:
        if c.layout.stages > 1:  # screened with GPipe's memory, not the unpipelined model's
            names = [n for n, _ in c.predicted.terms]
            assert names == ["residuals in flight", "stack buffers", "working set"]
    fitting = [c for c in ranked if c.fits]
    assert fitting == ranked[: len(fitting)]
    assert [c.step_seconds for c in fitting] == sorted(c.step_seconds for c in fitting)
    best = ranked[0]
    other = next(
        c
        for c in ranked
        if (c.fits or c.status.startswith("screened: slow"))
        and (c.layout.stages > 1) != (best.layout.stages > 1)
    )
    verdict = "a pipeline wins" if best.layout.stages > 1 else "no pipeline wins"
    assert f"{verdict}: " in out.getvalue() or f"{verdict}; " in out.getvalue()
    assert other.layout.name in out.getvalue()
    pipe = next(c for c in valid if c.layout.stages == 4)
    assert "Partitioner.num_stages = 4" in pipe.layout.gin("DecoderOnlyConfig")
    assert "pipeline_rules.base = 'fsdp'" in pipe.layout.gin("DecoderOnlyConfig")


@pytest.mark.parametrize("base, stages, num_partitions", [("megatron", 2, 2), ("fsdp", 4, 1)])
def test_1f1b_equals_unpipelined(base, stages, num_partitions):
    """1F1B (the hand-written backward of model/schedules.py), stage=2 x data=2 x model=2
    (Megatron) and stage=4 x data=2 (FSDP): three Adam steps give the unpipelined losses and
    parameters, and the first step's gradients, to fp32 rounding (the microbatches' gradients
    are summed in another order)."""
    pp = _trainer(base, stages, num_partitions, schedule="1f1b")
    ref = _trainer(base, 1, num_partitions)
    losses, grads, state = _run(pp)
    ref_losses, ref_grads, ref_state = _run(ref)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=2e-6)
    for p, r in zip(
        jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(ref_state.params)
    ):
        np.testing.assert_allclose(np.asarray(p), np.asarray(r), atol=5e-5)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_1f1b_timeline_is_a_valid_schedule(p, m):
    """The half-tick ops of model/schedules.py: every stage runs each microbatch's F then B
    once; F(i, s) follows F(i, s - 1), B(i, s) follows B(i, s + 1) and F(i, s); stage s holds
    at most min(p - s, m) microbatches (1F1B's bound, GPipe's is m); 2(m + p - 1) half-ticks,
    so the idle share is (p - 1) / (m + p - 1); one permute pair set per half-tick parity moves
    every send to the stage that consumes it next."""
    from t5lite.model.schedules import half_tick_op, half_tick_pairs

    n = 2 * (m + p - 1)
    when = {}
    for tau in range(n):
        for s in range(p):
            op, i = half_tick_op(tau, s, p, m)
            if op != "idle":
                assert (op, i, s) not in when
                when[(op, i, s)] = tau
    assert len(when) == 2 * m * p
    for i in range(m):
        for s in range(p):
            assert when[("F", i, s)] < when[("B", i, s)]
            if s:
                assert when[("F", i, s)] == when[("F", i, s - 1)] + 1
            if s < p - 1:
                assert when[("B", i, s)] == when[("B", i, s + 1)] + 1
    for s in range(p):
        held = [
            sum(when[("F", i, s)] <= tau < when[("B", i, s)] for i in range(m)) for tau in range(n)
        ]
        assert max(held) == min(p - s, m)
        busy = sum(half_tick_op(tau, s, p, m)[0] != "idle" for tau in range(n))
        assert 1 - busy / n == pytest.approx((p - 1) / (m + p - 1))
    for tau in range(n - 1):
        for src, dst in half_tick_pairs(p, tau % 2):
            op, i = half_tick_op(tau, src, p, m)
            nxt = half_tick_op(tau + 1, dst, p, m)
            if op != "idle":
                assert nxt == (op, i)
    assert half_tick_pairs(4, 0) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    assert half_tick_pairs(4, 1) == [(1, 2), (2, 1)] and half_tick_pairs(2, 1) == []


@pytest.mark.parametrize("base, stages, num_partitions", [("megatron", 2, 2), ("fsdp", 4, 1)])
def test_1f1b_permutes_bubble_memory_equal_the_analytic_model(base, stages, num_partitions):
    """1F1B at m = 4 (T = 4 + p - 1 ticks, a = one microbatch's 1 KiB): the compiled step's
    stage-to-stage permutes in loops are the forward pass's T plus one a half-tick of the
    schedule (p = 2: the odd half-ticks move nothing), 2T at p = 2 and 3T at p = 4; the
    bubble is GPipe's; the communication table's stage row agrees; the peak per device (p
    stage-input slots, one microbatch's residuals of the stage's layers) is within 10% of
    XLA's, and below GPipe's (which holds every tick's residuals)."""
    from t5lite.insight.comparison import compare_communication
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step, step_report

    tr = _trainer(base, stages, num_partitions, schedule="1f1b")
    compiled = compile_train_step(tr)
    f = insight_pipeline.pipeline_figures(tr, compiled.as_text())
    t, a = 4 + stages - 1, 1024
    assert f.permute_bytes == (a,) and f.in_flight_bytes == stages * a
    assert f.compiled_permutes == f.permutes == t * (2 if stages == 2 else 3)
    assert f.compiled_permute_bytes == f.permute_bytes_total == f.permutes * a
    assert (f.compiled_ticks, f.bubble) == (t, pytest.approx((stages - 1) / t))
    assert f.compiled_bubble == pytest.approx(f.bubble)
    assert f"{stages} stage inputs per stack (1F1B's slots" in f.format()
    step = step_report(tr, compiled=compiled)
    mine = [e for e in step.analytic.expected if e.axes == ("stage",)]
    assert [(e.kind, e.count, e.bytes) for e in mine] == [
        ("collective-permute", f.permutes, f.permutes * a),
        ("all-reduce", 1, 4 * a),
        ("collective-permute", 1, t * a),
        ("all-reduce", 1, 4 * a),
    ]
    (row,) = [
        c for c in compare_communication(step.collectives, step.analytic) if c.axes == ("stage",)
    ]
    assert row.agrees, row
    total = memory_report(compiled).total
    pm = insight_pipeline.pipeline_memory(tr)
    assert pm.stack_buffers == 3 * 4 * a
    assert abs(total / pm.total - 1) <= 0.10, (total, pm)
    gpipe = memory_report(compile_train_step(_trainer(base, stages, num_partitions))).total
    assert total < gpipe


@pytest.mark.parametrize("base, stages, num_partitions", [("fsdp", 2, 1), ("megatron", 4, 2)])
def test_1f1b_memory_within_10_percent(base, stages, num_partitions):
    """1F1B's analytic peak per device within 10% of XLA's where the stage's layer gradients
    are split over `data` (FSDP, data=4: a B reduce-scatters them in its layer scan, no
    unreduced copy is held) and with one layer a stage."""
    from t5lite.insight.memory import memory_report
    from t5lite.insight.report import compile_train_step

    tr = _trainer(base, stages, num_partitions, schedule="1f1b")
    compiled = memory_report(compile_train_step(tr)).total
    pm = insight_pipeline.pipeline_memory(tr)
    (a,) = insight_pipeline.pipeline_figures(tr).permute_bytes
    assert pm.stack_buffers == 3 * 4 * a
    assert abs(compiled / pm.total - 1) <= 0.10, (compiled, pm)


def test_plan_searches_schedules_beside_stage_counts():
    """`plan.schedules = ['gpipe', '1f1b']`: each pipelined layout once per schedule, 1F1B's
    screened with its own memory (p stage-input slots, below GPipe's every-tick residuals) and
    its gin naming the schedule; an unknown schedule is one line."""

    from t5lite.insight.plan import enumerate_layouts

    require_devices(8)
    layouts = enumerate_layouts(
        8, ["fsdp"], ["none"], stage_counts=(1, 2), batch_size=BATCH, schedules=("gpipe", "1f1b")
    )
    assert [(x.stages, x.data, x.schedule) for x in layouts if x.stages > 1] == [
        (2, 4, "gpipe"),
        (2, 4, "1f1b"),
        (2, 2, "gpipe"),
        (2, 2, "1f1b"),
        (2, 1, "gpipe"),
        (2, 1, "1f1b"),
    ]
    with pytest.raises(ValueError) as e:
        enumerate_layouts(8, ["fsdp"], ["none"], stage_counts=(2,), schedules=("zb",))
    assert str(e.value) == "plan: unknown schedule 'zb'; known: ('gpipe', '1f1b')"
    ranked, out = _plan_lm_fsdp(model_sizes=[2], stage_counts=(2,), schedules=("gpipe", "1f1b"))
    by = {c.layout.schedule: c for c in ranked}
    assert set(by) == {"gpipe", "1f1b"}
    assert by["1f1b"].predicted.total < by["gpipe"].predicted.total
    assert "pipeline_schedule = '1f1b'" in by["1f1b"].layout.gin("DecoderOnlyConfig")
    # The table tells the schedules apart; 1F1B's estimate counts its extra forward passes
    # and weight gathers (insight/plan.py `_fsdp_repeats`), slower than GPipe's here.
    rows = [x for x in out.getvalue().splitlines() if " 2:2x2 " in x]
    assert len(rows) == 2 and sum(" 2:2x2 1f1b " in x for x in rows) == 1
    assert by["1f1b"].estimate.step_s > by["gpipe"].estimate.step_s


def test_docs_pipeline_inspect_1f1b():
    """docs/pipeline.md's 1F1B inspect command as written: the bubble, the permutes (forward
    pass plus schedule) equal to the compiled step's, the slots, the memory within 10%."""
    import re

    from readme_blocks import block, run

    out = run(block("docs/pipeline.md", "pipeline-inspect-1f1b"), timeout=600).stdout
    assert "pipeline (1f1b): 2 stages over stage, 4 microbatches, 5 ticks a pass" in out
    assert "bubble: analytic (p-1)/(m+p-1) = 20.0%; compiled schedule (5 ticks) 20.0%" in out
    assert "analytic 10 x 16.00 KiB = 160.00 KiB; compiled 10 = 160.00 KiB" in out
    assert "2 stage inputs per stack (1F1B's slots; GPipe: 5 ticks' residuals)" in out
    (ratio,) = re.findall(r"memory per device: analytic .*\((\d\.\d\d)x\)", out)
    assert abs(float(ratio) - 1) <= 0.10
