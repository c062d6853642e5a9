"""The memory prediction of mixture-of-experts models against XLA:CPU's compiled train step:
expert weights, dispatch buffers and router temporaries, both dispatch modes, scanned and
unscanned layers, on 8 fake devices (docs/performance.md has the whole matrix)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import require_devices

from t5lite.insight import accuracy, memory, moe_memory
from t5lite.insight.activation_memory import PENDING
from t5lite.insight.report import compile_train_step
from t5lite.insight.topology import libtpu_available

# (family, preset, remat, scan_layers, dispatch, moe_every): one case per way the model
# differs (dropless's CPU masked matmuls by kernel layout, capacity's resharded hidden layer
# under 2D layouts, unscanned held values, every other layer sparse, remat minimal); the rest
# of the matrix is in docs/performance.md.
CASES = [
    ("lm", "megatron", "none", True, "dropless", 1),
    ("lm", "expert_parallel", "full", True, "dropless", 1),
    ("lm", "fully_sharded", "minimal", True, "capacity", 1),
    ("lm", "data_parallel", "none", True, "dropless", 1),
    ("t5", "megatron", "minimal", False, "capacity", 1),
    ("lm", "megatron", "none", False, "capacity", 2),
    # unscanned dropless without remat: every MoE layer's masked operands held at the loss
    # gradient (one sparse layer of two, and T5's four)
    ("lm", "megatron", "none", False, "dropless", 2),
    ("t5", "megatron", "none", False, "dropless", 1),
    # unscanned capacity, hidden layer resharded: every layer holds F-whole matmul outputs
    ("t5", "fully_sharded", "none", False, "capacity", 1),
    # unscanned dropless `full`, two experts a device: the heap packs the recomputed hidden
    # layer beside the masked operands
    ("lm", "fully_sharded", "full", False, "dropless", 1),
    # unscanned capacity `full`: an encoder's MoE recomputation hoisted with its attention and
    # the expert-kernel gradients not yet computed at the decoder's backward (megatron); the
    # resharded recomputation's F-whole pre-activations (fully_sharded)
    ("t5", "megatron", "full", False, "capacity", 1),
    ("t5", "fully_sharded", "full", False, "capacity", 1),
    # unscanned dropless under remat on megatron: each stack's last MoE layer recomputed
    # ahead of the loss gradient, its masked operands held there (`full` compiles to
    # `minimal`'s program); on fully_sharded the peak is in the encoder's last layer's
    # backward, the decoder's held values freed
    ("t5", "megatron", "full", False, "dropless", 1),
    ("t5", "fully_sharded", "minimal", False, "dropless", 1),
    # unscanned data parallel, experts over the batch's axis: no reduced copy of their
    # gradients in the update
    ("t5", "data_parallel", "minimal", False, "capacity", 2),
]


def _trainer(family, preset, remat, scan, dispatch, every):
    # data_parallel puts `expert` on data=8: it needs 8 experts.
    experts = 8 if preset == "data_parallel" else 4
    return accuracy.accuracy_trainer(
        family, preset, remat, scan, experts=experts, dispatch=dispatch, moe_every=every
    )


@pytest.mark.parametrize("family,preset,remat,scan,dispatch,every", CASES)
def test_moe_memory_within_ten_percent_of_compiled(family, preset, remat, scan, dispatch, every):
    require_devices(8)
    tr = _trainer(family, preset, remat, scan, dispatch, every)
    compiled = memory.memory_report(compile_train_step(tr))
    predicted = memory.predict_memory(tr)
    # The state (expert kernels and router included) is exact.
    assert predicted.state == compiled.aliased
    ratio = predicted.total / compiled.total
    assert abs(ratio - 1) < 0.10, (ratio, predicted, compiled)


def test_dropless_masked_matmuls_only_on_cpu():
    """On CPU `ragged_dot` is a masked dense matmul over each device's experts: the layer's
    backward holds four masked operands [E / data, M, D] (megatron: 2 of 4 experts a device,
    M = 16 * 128 * 2 rows, D = 256 > F / model = 192, fp32): 32 MiB that TPU and GPU's
    grouped ragged dot does not build."""
    require_devices(8)

    def work(trainer, platform):  # a layer's MoE backward working set (moe_memory.moe_bytes)
        cfg, length = trainer.model.network_config, trainer.lengths["targets"]
        a = memory.layer_bytes(
            trainer.partitioner, cfg, trainer.batch_size, length, [length], 4, platform=platform
        )
        return a["moe_work"]

    tr = _trainer("lm", "megatron", "none", True, "dropless", 1)
    assert work(tr, "cpu") - work(tr, "tpu") == 4 * 2 * (16 * 128 * 2) * 256 * 4 == 32 * 2**20
    # Unscanned, every layer holds its kernel gradients' masked operands at the loss gradient:
    # the rows masked twice [E / 2, M, D] and the hidden layer once [E / 2, M, F / 4] (8 + 8 +
    # 6 MiB a layer, XLA:CPU's buffer assignment), none of them on TPU.
    unscanned = _trainer("lm", "megatron", "none", False, "dropless", 1)
    cfg, length = unscanned.model.network_config, unscanned.lengths["targets"]
    held = [
        memory.layer_bytes(unscanned.partitioner, cfg, 16, length, [length], 4, platform=p)
        for p in ("cpu", "tpu")
    ]
    m = 16 * 128 * 2
    assert held[0]["moe_held"] - held[1]["moe_held"] == 2 * (2 * m * 256 + m * 192) * 4
    capacity = _trainer("lm", "megatron", "none", True, "capacity", 1)
    assert work(capacity, "cpu") == work(capacity, "tpu") > 0


def test_expert_gradient_bytes_by_layout():
    """One MoE layer's expert-kernel gradients (T5: wi_0, wi_1, wo, 4 experts, D 256, F 1024,
    fp32) split over `expert`'s axis (data=2) whatever the batch, and over `model` where
    `expert_mlp` takes it (megatron) or not at all (expert_parallel keeps F whole)."""
    require_devices(8)
    whole = 3 * 4 * 256 * 1024 * 4
    trainers = {
        p: _trainer("t5", p, "full", False, "capacity", 1) for p in ("megatron", "expert_parallel")
    }
    for preset, split in (("megatron", 2 * 4), ("expert_parallel", 2)):
        tr = trainers[preset]
        cfg = tr.model.network_config
        assert moe_memory.expert_gradient_bytes(tr.partitioner, cfg) == whole // split
    # Megatron's peak is inside the decoder's backward, where predict_memory counts three of
    # the four MoE layers' expert gradients (all but the layer in hand's) as not yet computed.
    terms = dict(memory.predict_memory(trainers["megatron"]).terms)
    assert terms[PENDING] == -3 * whole // 8
    # Expert parallelism's four times larger ones take its peak back to the loss gradient.
    assert PENDING not in dict(memory.predict_memory(trainers["expert_parallel"]).terms)


def test_tpu_resharded_hidden_buffers():
    """Where fully_sharded's rules split `expert_mlp` but the expert kernels keep F whole
    (`embed` takes `model` first), XLA:TPU's layer holds its hidden buffers F-whole as the
    matmuls give them: f32[2,16,80,768] (E/2 experts, 16 groups, 80 slots, F whole) against
    the rules' [2,16,80,192]; four of them in place of F-split ones, once a program
    (tpu_moe_memory.unscanned_moe); on expert_parallel and megatron the two layouts agree."""
    require_devices(8)
    from t5lite.insight import tpu_moe_memory

    def layer(preset):
        tr = _trainer("lm", preset, "none", False, "capacity", 1)
        cfg = tr.model.network_config
        a = memory.layer_bytes(tr.partitioner, cfg, 16, 128, [128], 4, True, "tpu")
        return {**a, "moe_share": 1.0}

    a = layer("fully_sharded")
    whole, split = 2 * 16 * 80 * 768 * 4, 2 * 16 * 80 * 192 * 4
    assert (a["moe_h"], a["moe_resharded"]) == (split, 4 * (whole - split))
    assert layer("expert_parallel")["moe_resharded"] == layer("megatron")["moe_resharded"] == 0

    def program(remat, layers, **kw):
        return tpu_moe_memory.MoeProgram(
            layers=layers,
            remat=remat,
            dispatch="capacity",
            gradients=0,
            copies=0,
            one_axis=False,
            **kw,
        )

    # Unrolled: counted once for two MoE layers; scanned `full`: as the four bf16 copies the
    # recomputed layer's backward reads.
    plain = tpu_moe_memory.unscanned_moe(program("none", ((2, {**a, "moe_resharded": 0}),)))
    resharded = tpu_moe_memory.unscanned_moe(program("none", ((2, a),)))
    assert resharded["moe (unrolled)"] - plain["moe (unrolled)"] == 4 * (whole - split)
    full = tpu_moe_memory.scanned_moe(program("full", ((2, a),)))
    assert full["moe (scanned)"] == 2 * (whole - split)


def test_tpu_gradients_in_vmem_under_full():
    """Under `full` a scanned program's stacked gradients stay in VMEM where they fit: on a
    one-axis mesh up to the budget (data_parallel), and for top-1 routing beside one
    recomputed layer's hidden buffer, even where its values spill without remat."""
    from t5lite.insight import tpu_moe_memory

    mib = 2**20
    a = {"moe": 39 * mib, "moe_h": 6 * mib, "moe_share": 1.0}

    def scanned(remat, gradients, **kw):
        return tpu_moe_memory.scanned_moe(
            tpu_moe_memory.MoeProgram(
                layers=((2, a),),
                remat=remat,
                dispatch="dropless",
                gradients=gradients,
                copies=gradients,
                vmem=32 * mib,
                **kw,
            )
        )

    one_axis = dict(one_axis=True, spill=True)
    assert scanned("full", 22 * mib, **one_axis) == {"stacked gradients": 0}
    assert scanned("full", 40 * mib, **one_axis) == {"stacked gradients": 8 * mib}
    assert scanned("none", 22 * mib, **one_axis) == {"stacked gradients": 22 * mib}
    assert scanned("none", 22 * mib, one_axis=True, spill=False) == {}
    top1 = dict(one_axis=False, spill=True, top_k=1)
    assert scanned("full", 26 * mib, **top1) == {}
    assert scanned("full", 27 * mib, **top1) == {"stacked gradients": 27 * mib}
    # Top-2: the recomputed layer's values and the parameters' copies leave VMEM too.
    assert scanned("full", 26 * mib, one_axis=False, spill=True)["moe (scanned)"] > 0


_TPU_SCRIPT = """
import json, sys
from t5lite.insight import accuracy, memory
from t5lite.insight.meshes import partitioner_on
from t5lite.insight.report import compile_train_step
from t5lite.insight.topology import get_topology
from t5lite.trainer import Trainer

family, preset, remat, scan, dispatch, layers = json.loads(sys.argv[1])
tr = accuracy.accuracy_trainer(
    family, preset, remat, scan=scan, layers=layers, experts=4, dispatch=dispatch
)
tr = Trainer(
    tr.model, partitioner_on(tr.partitioner, get_topology("v5e:2x4").devices),
    batch_size=tr.batch_size, lengths=tr.lengths,
)
compiled = memory.memory_report(compile_train_step(tr)).total
print("RESULT " + json.dumps([compiled, memory.predict_memory(tr).total]))
"""


@pytest.mark.skipif(not libtpu_available(), reason='libtpu not installed (pip install ".[tpu]")')
def test_tpu_resharded_moe_within_ten_percent_of_compiled():
    """XLA:TPU ahead of time (v5e:2x4): the scanned decoder-only MoE model on fully_sharded
    under `full`, whose recomputed layer the TPU program holds F-whole (four bf16 copies of
    its hidden buffers), within 10% of the compiled step. In a fresh process: the TPU plugin
    never meets the session's fake CPU devices."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    case = ["lm", "fully_sharded", "full", True, "capacity", 2]
    out = subprocess.run(
        [sys.executable, "-c", _TPU_SCRIPT, json.dumps(case)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    compiled, predicted = json.loads(line.removeprefix("RESULT "))
    assert abs(predicted / compiled - 1) < 0.10, (predicted, compiled)
