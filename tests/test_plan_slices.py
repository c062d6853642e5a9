"""Multi-slice planning: collectives that cross the data-center network run at its rate, and
`plan` over slices searches `replica x data x model` layouts beside pipelines whose stages are
the slices."""

import collections
import io

import gin
import jax
import numpy as np
import pytest
from conftest import require_devices, run_cli
from jax.sharding import Mesh
from test_pipeline import BATCH, LENGTHS, LM

from t5lite.cli import registry as gin_registry
from t5lite.insight.communication import link_bytes
from t5lite.insight.hardware import DeviceSpec, device_spec_named
from t5lite.insight.hlo import parse_collectives
from t5lite.insight.plan import build_trainer, enumerate_layouts, plan
from t5lite.insight.report import analytic_figures, compile_train_step
from t5lite.insight.slices import compiled_link_bytes, crosses_slices, dcn_axes, mesh_slices
from t5lite.insight.types import Layout
from t5lite.model import network, optimizers
from t5lite.model.models import DecoderOnlyModel

CPU = DeviceSpec("cpu", None, 100e12, 100e9, 1e12, dcn_bytes_per_s=1e9, slice_devices=4)


def _model() -> DecoderOnlyModel:
    return DecoderOnlyModel(network.DecoderOnlyConfig(**LM), optimizer=optimizers.AdamW(1e-2))


def _mesh(shape: dict[str, int]) -> Mesh:
    grid = np.asarray(jax.devices()[:8], dtype=object).reshape(tuple(shape.values()))
    return Mesh(grid, tuple(shape))


def test_axes_that_cross_slices():
    """Two slices of four consecutive devices: the outermost axis that splits them crosses."""
    require_devices(8)
    for shape, slow in (
        ({"replica": 2, "data": 2, "model": 2}, {"replica"}),
        ({"stage": 2, "data": 4, "model": 1}, {"stage"}),
        ({"data": 4, "model": 2}, {"data"}),  # data's 4 span both slices
        ({"data": 2, "model": 4}, {"data"}),
        ({"data": 1, "model": 8}, {"model"}),
    ):
        mesh = _mesh(shape)
        slices = mesh_slices(mesh, CPU)
        assert slices.reshape(-1).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
        assert dcn_axes(mesh, slices) == slow, shape
    one = DeviceSpec("cpu", None, None, None)
    assert mesh_slices(_mesh({"data": 8, "model": 1}), one) is None


def test_compiled_dcn_bytes_are_the_replica_axis_collectives():
    """Under `fsdp` over `replica x data x model` the collectives that cross slices (by their
    device groups) are exactly those over `replica`; the analytic step charges its `replica`
    rows (the gradients' all-reduce) at the DCN rate and the rest at the links'."""
    require_devices(8)
    layout = Layout(2, 2, "fsdp", "none", replicas=2)
    tr = build_trainer(layout, _model(), jax.devices()[:8], BATCH, LENGTHS)
    mesh = tr.partitioner.mesh
    collectives = parse_collectives(compile_train_step(tr).as_text(), mesh)
    slices = mesh_slices(mesh, CPU)
    crossing = [c for c in collectives if crosses_slices(c, slices)]
    assert crossing == [c for c in collectives if "replica" in c.axes]
    ici, dcn = compiled_link_bytes(collectives, slices)
    assert dcn == sum(map(link_bytes, crossing))
    assert ici + dcn == sum(map(link_bytes, collectives))
    a = analytic_figures(tr, CPU)
    over_replica = [e for e in a.communication.expected if "replica" in e.axes]
    assert [(e.kind, e.why) for e in over_replica] == [
        ("all-reduce", "gradients summed over the batch")
    ]
    est = a.estimate
    assert est.dcn_bytes == over_replica[0].link_bytes > 0
    # One second of DCN costs 1e9 bytes, of the links 100e9.
    assert est.communication_s == pytest.approx(
        (est.link_bytes - est.dcn_bytes) / 100e9 + est.dcn_bytes / 1e9
    )
    # XLA:CPU all-reduces each gradient over `replica` before scattering it over `data` (the
    # gradient split over `model` only, twice the shard the analytic row sends; documented in
    # docs/pipeline.md), plus the loss's and the norm scales' small sums.
    big = sum(c.bytes for c in crossing if c.kind == "all-reduce" and c.axes == ("replica",))
    assert big == 2 * over_replica[0].bytes - 576


def _plan(dcn_gbps: float, **kwargs) -> tuple[list, str]:
    out = io.StringIO()
    ranked = plan(
        model=_model(),
        task_feature_lengths=LENGTHS,
        batch_size=BATCH,
        num_devices=8,
        presets=["fsdp"],
        remat_policies=["none"],
        stage_counts=(1, 2),
        slices=2,
        dcn_bandwidth_gbps=dcn_gbps,
        top_k=3,
        stream=out,
        progress=io.StringIO(),
        wide=True,
        **kwargs,
    )
    return ranked, out.getvalue()


def test_plan_over_slow_dcn_picks_the_pipeline_whose_stages_are_the_slices(tmp_path):
    """Two slices joined by a slow network: FSDP over both slices gathers weights across it,
    a replica per slice all-reduces gradients across it, a pipeline of two stages (a slice
    each) sends only activations across it: the pipeline wins on the compiled step. With the
    network as fast as the links the bubble costs more than it saves."""
    require_devices(8)
    gin_path = tmp_path / "best.gin"
    ranked, text = _plan(0.001, output_gin=str(gin_path))
    best = ranked[0]
    assert best.fits and best.layout.stages == 2 and best.layout.replicas == 1
    assert "a pipeline wins" in text and "slices of 4 devices joined by DCN at 0.001 GB/s" in text
    replica = [c for c in ranked if c.layout.replicas == 2 and c.fits]
    assert replica, "a replica layout was compiled"
    # Compiled DCN seconds rank them: the pipeline's activations against replica's gradients.
    assert best.step_seconds < min(c.step_seconds for c in replica)
    assert "2x2x2" in text  # the table writes a replica layout's mesh as replica x data x model
    with gin.unlock_config():
        gin.clear_config()
        try:
            gin.parse_config_file(str(gin_path))
            p = gin_registry.Partitioner()
            assert dict(p.mesh.shape) == {"stage": 2, "data": best.layout.data, "model": 1}
        finally:
            gin.clear_config()

    ranked, text = _plan(100.0)
    assert ranked[0].layout.stages == 1 and "no pipeline wins" in text


def test_replica_layout_gin_builds_its_mesh_and_rules():
    require_devices(8)
    layout = next(x for x in enumerate_layouts(8, ["fsdp"], ["none"], slices=2) if x.replicas > 1)
    assert (layout.replicas, layout.data, layout.model) == (2, 4, 1)
    with gin.unlock_config():
        gin.clear_config()
        try:
            gin.parse_config(layout.gin("DecoderOnlyConfig"))
            p = gin_registry.Partitioner()
            assert dict(p.mesh.shape) == {"replica": 2, "data": 4, "model": 1}
            assert p.rules == layout.rules()
            assert dict(p.rules)["batch"] == ("replica", "data")
        finally:
            gin.clear_config()


def _plan_bare(**kwargs) -> None:
    plan(
        model=_model(),
        task_feature_lengths=LENGTHS,
        batch_size=BATCH,
        num_devices=8,
        stream=io.StringIO(),
        progress=io.StringIO(),
        **kwargs,
    )


def test_slices_mistakes():
    """Before any layout is built: slices that do not divide the devices, and slices on a
    device without a DCN figure and none given."""
    require_devices(8)
    with pytest.raises(ValueError, match=r"^plan: slices=3 does not divide the 8 devices$"):
        _plan_bare(slices=3, dcn_bandwidth_gbps=1.0)
    with pytest.raises(ValueError, match=r"slices=2 needs plan.dcn_bandwidth_gbps: .* 'cpu'$"):
        _plan_bare(slices=2)
    # v5e's data sheet gives its DCN: 2 x 100 Gbit/s NICs a host of 8 chips.
    assert device_spec_named("v5e").dcn_bytes_per_s == 3.125e9


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--gin.plan.slices=2"],
            "plan: slices=2 needs plan.dcn_bandwidth_gbps: the hardware table has no DCN figure "
            "for 'cpu'",
        ),
        (
            ["--gin.plan.slices=3", "--gin.plan.dcn_bandwidth_gbps=3.1"],
            "plan: slices=3 does not divide the 8 devices",
        ),
    ],
)
def test_cli_slices_mistakes_are_one_line(flags, line, capsys):
    """From the CLI with gin alone: one line, exit 1, before any layout is screened."""
    require_devices(8)
    rc = run_cli("plan", "--gin_file=plan.gin", "--host_device_count=8", *flags)
    captured = capsys.readouterr()
    assert rc == 1 and captured.err.strip().splitlines() == [f"t5lite plan: error: {line}"]
    assert "screening" not in captured.err and captured.out == ""


def test_a_two_slice_tpu_topology_compiles_dcn_transfers_as_collectives():
    """`2xv5e:2x2`: two compile-only v5e slices. XLA:TPU compiles what crosses them to the DCN
    runtime's transfers (`send` with `_xla_megascale_transfer_type`), which hlo.py reads as
    the collective they implement over the mesh axes that cross slices: under a replica a
    slice, all-reduces over `replica` and nothing else crossing."""
    pytest.importorskip("libtpu")
    from t5lite.insight.topology import get_topology, num_devices

    assert num_devices("2xv5e:2x2") == 8
    topo = get_topology("2xv5e:2x2")
    assert [d.slice_index for d in topo.devices] == [0] * 4 + [1] * 4
    assert topo.spec.memory_bytes == 16 * 2**30  # a chip a device, as one slice's
    tr = build_trainer(
        Layout(2, 2, "fsdp", "none", replicas=2), _model(), topo.devices, 16, LENGTHS
    )
    mesh = tr.partitioner.mesh
    hlo = compile_train_step(tr).as_text()
    sends = [x for x in hlo.splitlines() if " send(" in x and "_xla_megascale_" in x]
    collectives = parse_collectives(hlo, mesh)
    slices = mesh_slices(mesh, topo.spec)
    crossing = [c for c in collectives if crosses_slices(c, slices)]
    assert len(crossing) == len(sends) > 0 and all(c.axes == ("replica",) for c in crossing)
    kinds = collections.Counter(c.kind for c in crossing)
    # The gradients' sums; the embedding lookup's token ids gathered and its rows traded back
    # (the batch is split over `('replica', 'data')`, the table's rows over `data`).
    assert kinds == {"all-reduce": 19, "all-gather": 1, "collective-permute": 2}
    crossing = [c for c in crossing if c.kind == "all-reduce"]
    est = analytic_figures(tr, topo.spec).estimate
    # XLA:TPU scatters the gradients over `data` first and sums the shards across slices:
    # about the analytic bytes (not `data` times them, as XLA:CPU sends), tiles padded to 128.
    assert est.dcn_bytes <= sum(c.bytes for c in crossing) <= 8 * est.dcn_bytes


def test_plan_lays_meshes_across_a_two_slice_topology():
    """On `2xv5e:2x2` plan takes its slices from the devices: replica layouts join the
    search, and a mesh without stages puts `data`'s outer half over DCN (each slice, and each
    process, a contiguous half of the batch), where a topology-ordered mesh failed the batch
    check."""
    pytest.importorskip("libtpu")
    from t5lite.insight.topology import get_topology

    topo = get_topology("2xv5e:2x2")
    layouts = enumerate_layouts(8, ["fsdp"], ["none"], slices=2)
    assert [x.mesh for x in layouts if x.replicas > 1] == ["2x4x1", "2x2x2", "2x1x4"]
    tr = build_trainer(Layout(4, 2, "fsdp", "none"), _model(), topo.devices, 16, LENGTHS)
    mesh = tr.partitioner.mesh
    slices = mesh_slices(mesh, topo.spec)
    assert slices.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
    assert dcn_axes(mesh, slices) == {"data"}


def test_docs_llama_7b_over_two_v5e_slices_pipelines():
    """docs/pipeline.md's command as written: Llama-2-7B on two slices of 8 v5e chips (16 fake
    devices, a process of its own). FSDP across the slices gathers every layer over DCN and a
    replica a slice does not fit, so the two-stage pipeline (a slice a stage) wins, compiled."""
    from readme_blocks import block, run

    out = run(block("docs/pipeline.md", "pipeline-plan-slices"), timeout=900).stdout
    assert "slices of 8 devices joined by DCN at 3.12 GB/s a device" in out
    assert "best: fsdp data=4 model=2 remat=full stage=2 m=2" in out
    assert "a pipeline wins: fsdp data=4 model=2 remat=full stage=2 m=2; the best without " in out
    rows = {tuple(x.split()[1:4]): x.split() for x in out.splitlines() if x[:1].isdigit()}
    assert rows[("fsdp", "2:4x2", "full")][-1] == "fits"
    # a replica a slice holds 7B parameters' state on 8 chips: over 16 GiB + 10%, not compiled
    replica = rows[("fsdp", "2x8x1", "full")]
    assert replica[4:6] == ["17.79", "GiB"] and replica[6] == "-"
