"""Memory and communication reports, and the layout search, against hand-computed figures."""

import io
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from conftest import require_devices
from jax.sharding import PartitionSpec as P

from t5lite.insight import communication, comparison, memory
from t5lite.insight import plan as plan_lib
from t5lite.insight import report as rep
from t5lite.insight.hardware import DeviceSpec
from t5lite.insight.hlo import parse_collectives
from t5lite.insight.sharding import sharding_report
from t5lite.insight.slices import compiled_link_bytes, link_seconds, mesh_slices
from t5lite.model.models import DecoderOnlyModel
from t5lite.model.network import DecoderOnlyConfig
from t5lite.partitioning import (
    PRESETS,
    Partitioner,
    create_mesh,
    data_parallel_logical_axis_rules,
    preset_rules,
    standard_logical_axis_rules,
)
from t5lite.trainer import Trainer

B, L, D, F = 16, 8, 32, 64  # batch, length, width, MLP width of the hand-computed layouts


def tiny_lm(num_layers=1, **kw):
    cfg = DecoderOnlyConfig(
        vocab_size=128, emb_dim=D, num_heads=4, head_dim=8, mlp_dim=F, num_layers=num_layers, **kw
    )
    return DecoderOnlyModel(network_config=cfg)


def trainer_for(model, num_partitions, rules, batch_size=B):
    part = Partitioner(create_mesh(num_partitions), logical_axis_rules=rules)
    return Trainer(model, part, batch_size=batch_size, lengths={"targets": L})


# --- hand-computed toy layout -----------------------------------------------------------------


def test_toy_megatron_mlp_figures_equal_hand_computed():
    """x[B, D] @ wi[D, F/model] -> gelu -> @ wo[F/model, D] on data=2 x model=4."""
    require_devices(8)
    part = Partitioner(create_mesh(4), logical_axis_rules=standard_logical_axis_rules())

    def mlp(x, wi, wo):
        return jax.nn.gelu(x @ wi) @ wo

    fn = part.partition(mlp, (P("data", None), P(None, "model"), P("model", None)), P("data"))
    abstract = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(B, D), (D, F), (F, D)]]
    compiled = part.compile(fn, *abstract)
    mem = memory.memory_report(compiled, device_memory=1 << 20)
    # Per device: x 8x32, wi 32x16, wo 16x32 floats in; y 8x32 out.
    assert mem.arguments == 4 * (8 * 32 + 32 * 16 + 16 * 32) == 5120
    assert mem.outputs == 4 * 8 * 32 == 1024
    assert mem.fits is True
    rows = communication.collective_rows(parse_collectives(compiled.as_text(), part.mesh))
    # Exactly one all-reduce over `model` of the row-parallel output, 8x32 floats; a ring
    # all-reduce over 4 devices sends 2 * 3/4 of it.
    assert [(r.kind, r.axes, r.count, r.bytes) for r in rows] == [
        ("all-reduce", ("model",), 1, 1024)
    ]
    assert rows[0].link_bytes == pytest.approx(1536)
    # One slice: every byte at the link rate (insight/slices.py).
    collectives = parse_collectives(compiled.as_text(), part.mesh)
    one = DeviceSpec("cpu", None, None, 1536.0)
    ici, dcn = compiled_link_bytes(collectives, mesh_slices(part.mesh, one))
    assert (ici, dcn) == (1536.0, 0.0) and link_seconds(ici, dcn, one) == pytest.approx(1.0)


def test_analytic_communication_hand_computed():
    require_devices(8)
    model = tiny_lm(num_layers=2)
    tr = trainer_for(model, 4, standard_logical_axis_rules())
    report = sharding_report(tr.partitioner, tr.abstract_state().params, tr.params_axes)
    a = communication.analytic_communication(tr, report)
    # Megatron, 1D parameters: each data group all-reduces the gradients of one model shard.
    assert a.data_axes == ("data",)
    # (norm scales are replicated, so this is the bytes per device, not a quarter of the total)
    assert a.data_axes_bytes == report.bytes_per_device < report.bytes_total // 2
    # 2 layers x 2 blocks x (forward + backward), + the vocab-parallel embedding lookup
    # (forward) and the logits' input gradient (backward), each one [B/2, L, D] fp32.
    assert a.model_axis_bytes == (2 * 2 * 2 + 1 + 1) * (B // 2) * L * D * 4


def test_tensor_2d_layer_figures_against_summa_and_megatron():
    require_devices(8)
    model = tiny_lm()  # gated: wi_0, wi_1, wo, 3 matrices D x F
    # data = model = 2: SUMMA's square grid.
    part = Partitioner(
        create_mesh(2, devices=jax.devices()[:4]), logical_axis_rules=preset_rules("tensor_2d")
    )
    tr = Trainer(model, part, batch_size=B, lengths={"targets": L})
    fig = communication.tensor_2d_mlp_figures(tr)
    # T = 16 x 8 = 128 tokens, D = 32, F = 64, q = 2. Rules-only 2D: 3 weights gathered over
    # data to D·F/2 each (1/2 received), x gathered and the output reduce-scattered over model
    # (T·D/2 each, 1/2 received): 1536 + 2048. SUMMA: (q-1)/q² · (2(T·D + D·F) + T·F + D·F).
    # Megatron: one all-reduce of T·D/2, 2 · 1/2 received.
    assert (fig.received_2d, fig.received_summa, fig.received_megatron) == (3584, 5632, 2048)
    assert (fig.weights_2d, fig.weights_megatron) == (1536, 3072)
    assert (fig.activations_2d, fig.activations_megatron) == (1024, 2048)
    # inspect prints them under the model axis's compiled-vs-analytic row.
    report = sharding_report(part, tr.abstract_state().params, tr.params_axes)
    a = communication.analytic_communication(tr, report)
    lines = comparison.format_comparison(comparison.compare_communication([], a))
    summa = next(x for x in lines if "SUMMA / Optimus q x q" in x)
    assert summa.split()[-3:] == ["5,632", "1,536", "1,024"]
    assert next(x for x in lines if "1D Megatron" in x).split()[-3:] == ["2,048", "3,072", "2,048"]
    # Only 2D layouts get them.
    megatron = trainer_for(model, 4, standard_logical_axis_rules())
    assert communication.tensor_2d_mlp_figures(megatron) is None


def test_sequence_parallel_analytic_is_megatron_volume_as_all_gather_and_reduce_scatter():
    require_devices(8)
    model = tiny_lm(num_layers=2)
    sp = trainer_for(model, 4, preset_rules("sequence_parallel"))
    mt = trainer_for(model, 4, preset_rules("megatron"))
    figures = []
    for tr in (sp, mt):
        report = sharding_report(tr.partitioner, tr.abstract_state().params, tr.params_axes)
        a = communication.analytic_communication(tr, report)
        figures.append({e.kind: e for e in a.expected if e.axes == ("model",)})
    sp_model, mt_model = figures
    assert set(sp_model) == {"all-gather", "reduce-scatter"} and set(mt_model) == {"all-reduce"}
    assert "sequence parallelism" in sp_model["reduce-scatter"].why
    # Per block: an all-gather and a reduce-scatter where Megatron all-reduces, same bytes sent.
    assert sp_model["all-gather"].count == sp_model["reduce-scatter"].count
    assert sp_model["all-gather"].count == mt_model["all-reduce"].count
    sent = sp_model["all-gather"].link_bytes + sp_model["reduce-scatter"].link_bytes
    assert sent == pytest.approx(mt_model["all-reduce"].link_bytes)


# --- compiled steps ---------------------------------------------------------------------------


def _forward_all_reduces(num_layers):
    tr = trainer_for(tiny_lm(num_layers), 4, standard_logical_axis_rules())
    compiled = tr.partitioner.compile(tr.eval_step, tr.abstract_state().params, tr.batch_abstract)
    act_bytes = (B // 2) * L * D * 4  # one [B/data, L, D] fp32 activation
    # Others over `model` are the vocab-parallel softmax's [B/data, L] max and sum.
    return sum(
        1
        for c in parse_collectives(compiled.as_text(), tr.partitioner.mesh)
        if c.kind == "all-reduce" and c.axes == ("model",) and c.bytes == act_bytes
    )


def test_megatron_two_all_reduces_per_layer_forward():
    require_devices(8)
    one, three = _forward_all_reduces(1), _forward_all_reduces(3)
    assert (three - one) / 2 == 2  # one per block: attention and MLP
    assert one == 2 + 1  # + the vocab-parallel embedding lookup


@pytest.fixture(scope="module")
def dp_step():
    require_devices(8)
    tr = trainer_for(tiny_lm(), 1, data_parallel_logical_axis_rules(), batch_size=8)
    return tr, rep.step_report(tr)


def test_data_parallel_all_reduce_bytes_equal_parameter_bytes(dp_step):
    tr, step = dp_step
    report = sharding_report(tr.partitioner, tr.abstract_state().params, tr.params_axes)
    param_bytes = report.bytes_total
    ar = step.bytes_over(("data",), "all-reduce")
    # The gradient all-reduce (XLA combines it into one), plus the loss metrics: a few fp32
    # scalars and a [L * B/data + 1] histogram, 276 bytes here.
    assert param_bytes <= ar <= param_bytes * 1.005, (ar, param_bytes)
    assert step.count("all-reduce", ("data",)) >= 1
    assert step.analytic.data_axes_bytes == param_bytes
    assert step.count("all-gather") == 0 and step.bytes_over(("model",)) == 0


def test_predicted_memory_within_ten_percent_of_compiled(dp_step):
    _, step = dp_step
    m, p = step.memory, step.predicted
    assert p.state + p.batch == m.arguments  # the train state and batch: exact
    assert abs(p.total / m.total - 1) < 0.10, (p, m)


def test_inspect_prints_memory_collectives_and_analytic(tmp_path):
    require_devices(8)
    out = io.StringIO()
    part = Partitioner(create_mesh(2), logical_axis_rules=standard_logical_axis_rules(1, 2))
    _, step = rep.inspect(
        model=tiny_lm(),
        task_feature_lengths={"targets": L},
        batch_size=B,
        partitioner=part,
        device_memory_gib=1.0,
        output_json=str(tmp_path / "r.json"),
        stream=out,
        progress=(progress := io.StringIO()),
    )
    text = out.getvalue()
    stages = progress.getvalue().splitlines()
    assert stages[-3].startswith("inspect: lowering the train step")
    assert re.fullmatch(r"inspect: lowered in \d+ s; compiling with XLA .*\.\.\.", stages[-2])
    assert re.fullmatch(r"inspect: compiled in \d+ s", stages[-1])
    assert text.startswith("summary (mesh data=4 x model=2):\n  verdict: FITS on cpu: ")
    for s in ("temporaries", "of 1.00 GiB", "fits", "all-gather",
              "≈ parameters", "≈ activations of split layers", "bytes/dev"):  # fmt: skip
        assert s in text, s
    # ZeRO-3: the 8 kernels' gradients reduce-scattered over `data` (t5lite/collectives.py), to
    # their shards: wi_0, wi_1, wo 8x32, q, k, v, out 8x2x8, logits 8x64 (7.00 KiB of fp32).
    assert re.search(r"reduce-scatter\s+data\s+8\s+7.00 KiB", text)
    # Beside ZeRO-3's figure, by hand: a layer's q, k, v, out (32x4x8 fp32 each) and wi_0, wi_1,
    # wo (32x64) on 8 devices, 512 B and 1 KiB each; the logits' 32x128, 2 KiB. A ring
    # reduce-scatter over 4 devices sends 3 times its result.
    assert (
        "ZeRO-3 over data (4 devices), each dense kernel's gradient reduce-scattered; results "
        "per device:\n"
        "  decoder/layers_N                   5.00 KiB\n"
        "  decoder/logits_dense               2.00 KiB\n"
        "  analytic: 8 reduce-scatters, 7.00 KiB (21.00 KiB sent)\n"
        "  compiled: 8 reduce-scatters, 7.00 KiB (21.00 KiB sent): ratio 1.00, agrees\n"
    ) in text
    assert step.memory.fits and step.count("all-gather", ("data",)) > 0
    assert (tmp_path / "r.json").stat().st_size > 0


# --- plan -------------------------------------------------------------------------------------


def test_plan_drops_replicated_layout_and_writes_a_trainable_winner(tmp_path, monkeypatch):
    require_devices(8)
    model = tiny_lm()
    predictions = []  # every analytic memory prediction plan makes
    real_predict = rep.predict_memory
    monkeypatch.setattr(rep, "predict_memory", lambda t: predictions.append(t) or real_predict(t))
    out = io.StringIO()
    gin_path = tmp_path / "best.gin"
    # A budget between the sharded and the replicated train step: data parallelism must go.
    ranked = plan_lib.plan(
        model=model,
        task_feature_lengths={"targets": L},
        batch_size=B,
        num_devices=8,
        device_memory_gib=300 / 2**20,  # 300 KiB: sharded ~180 KiB, replicated ~400 KiB
        presets=["data_parallel", "megatron"],
        remat_policies=["none"],
        model_sizes=[1, 4, 8],
        output_gin=str(gin_path),
        stream=out,
    )
    by_name = {(c.layout.preset, c.layout.model): c for c in ranked}
    dp = by_name[("data_parallel", 1)]
    # Screened out analytically, or compiled and found too large.
    assert dp.status == "does not fit" or dp.status == "screened: memory"
    # Only candidates the analytic screen kept were compiled, the fastest first.
    compiled = [c for c in ranked if c.step is not None]
    assert compiled and all(c.predicted.total <= 1.1 * 300 * 1024 for c in compiled)
    # Compiling reuses what screening built: one prediction per buildable layout, no more.
    assert len(predictions) == sum(not c.status.startswith("invalid:") for c in ranked)
    assert all(c.step.predicted is c.predicted for c in compiled)
    assert all(c.step.analytic is c.analytic.communication for c in compiled)
    best = ranked[0]
    assert best.fits and best.layout.preset != "data_parallel"
    assert ranked.index(dp) > max(ranked.index(c) for c in ranked if c.fits)
    # 4 heads cannot be split 8 ways: skipped with the reason.
    assert by_name[("megatron", 8)].status.startswith("invalid:")
    assert "dimension 1 of size 4 is not divisible by mesh axes 'model' of size 8" in (
        by_name[("megatron", 8)].status
    )
    assert "invalid" in out.getvalue() and "best:" in out.getvalue()
    table = [x for x in out.getvalue().splitlines() if not x.startswith("best:")]
    assert max(map(len, table)) <= 100
    text = gin_path.read_text()
    assert f"NUM_PARTITIONS = {best.layout.model}" in text
    assert "network.DecoderOnlyConfig.remat_policy = %REMAT_POLICY" in text
    # The written layout parses with the shipped configs into a partitioner of that shape.
    import gin

    from t5lite.cli import registry as gin_registry

    with gin.unlock_config():
        gin.clear_config()
        try:
            gin.parse_config_file(str(gin_path))
            p = gin_registry.Partitioner()
            assert dict(p.mesh.shape) == {"data": best.layout.data, "model": best.layout.model}
            assert p.rules == best.layout.rules()
        finally:
            gin.clear_config()


def test_enumerate_layouts_dedupes_and_validates():
    layouts = plan_lib.enumerate_layouts(8, remat_policies=["none"])
    names = {(x.preset, x.data, x.model) for x in layouts}
    assert ("data_parallel", 8, 1) in names and ("data_parallel", 4, 2) not in names
    assert ("fsdp", 8, 1) in names and ("megatron", 8, 1) not in names
    # data_parallel once, fsdp on model = 1, 2, 4, 8, every other preset on model = 2, 4, 8.
    assert len(layouts) == 1 + 4 + 3 * (len(PRESETS) - 2)
    with pytest.raises(ValueError, match="unknown preset 'zero'"):
        plan_lib.enumerate_layouts(8, presets=["zero"])


def test_plan_compiles_one_rules_table_once():
    """`tensor_2d` is `fully_sharded`'s table under another name: the same program."""
    require_devices(8)
    out, progress = io.StringIO(), io.StringIO()
    ranked = plan_lib.plan(
        model=tiny_lm(), task_feature_lengths={"targets": L}, batch_size=B, num_devices=8,
        presets=["fully_sharded", "tensor_2d"], remat_policies=["none"], model_sizes=[2],
        top_k=2, stream=out, progress=progress,
    )  # fmt: skip
    first, second = sorted(ranked, key=lambda c: c.status != "fits")
    assert first.fits and first.compile_seconds > 0
    assert second.status == f"same rules as {first.layout.preset}: not compiled again"
    assert second.memory == first.memory and second.layout.preset != first.layout.preset
    assert progress.getvalue().count("compiling...") == 1
    assert f"{second.layout.name}: same rules as" in progress.getvalue()


# --- full size, abstractly ------------------------------------------------------------------

_XXL = textwrap.dedent(
    """
    import io, jax
    from t5lite.insight import report as rep
    from t5lite.model.models import EncoderDecoderModel
    from t5lite.model.network import T5Config
    from t5lite.partitioning import Partitioner, create_mesh, standard_logical_axis_rules
    assert jax.device_count() == 256
    cfg = T5Config(emb_dim=4096, num_heads=64, mlp_dim=10240, num_encoder_layers=24,
                   num_decoder_layers=24, dtype="bfloat16", remat_policy="full",
                   scan_layers=True)
    part = Partitioner(create_mesh(16), logical_axis_rules=standard_logical_axis_rules(1, 2))
    out = io.StringIO()
    sharding, step = rep.inspect(model=EncoderDecoderModel(network_config=cfg),
                                 task_feature_lengths={"inputs": 512, "targets": 114},
                                 batch_size=512, partitioner=part, device_memory_gib=16,
                                 compile=False, stream=out)
    assert sharding.num_parameters == 11_135_332_352, sharding.num_parameters
    assert "mesh: data=16 x model=16" in out.getvalue()
    print("PER_DEVICE", sharding.bytes_per_device, step.predicted.total,
          step.analytic.data_axes_bytes, step.analytic.model_axis_bytes)
    """
)


def test_t5_xxl_on_256_fake_devices_abstractly():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=256")
    out = subprocess.run(
        [sys.executable, "-c", _XXL], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("PER_DEVICE"))
    params_per_dev, predicted, data_bytes, model_bytes = map(int, line.split()[1:])
    # 11.1e9 fp32 parameters over 256 devices, every weight split both ways (FSDP).
    assert params_per_dev == pytest.approx(11_135_332_352 * 4 / 256, rel=0.01)
    # Scanned with full remat it fits a 16 GiB chip (unscanned, XLA keeps more than the layer
    # inputs: see t5lite/insight/memory.py).
    assert predicted < 16 * 2**30
    assert data_bytes > 0 and model_bytes > 0
