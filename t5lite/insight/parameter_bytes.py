"""Bytes per device of what the train step holds whatever its activations: the train state,
the batch, the parameters' gradients (unreduced over the batch's mesh axes until the reduction,
a scanned stack's reduced layer by layer) and FSDP's gathered layer weights, from shapes and
shardings alone (`memory.predict_memory` and `pipeline` size the step with them)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from t5lite.partitioning import mesh_axes_of
from t5lite.trainer import Trainer


def tree_bytes_per_device(tree: Any, min_itemsize: int = 0) -> int:
    """Bytes of one device's shards of a tree of sharded `ShapeDtypeStruct`s."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * max(np.dtype(x.dtype).itemsize, min_itemsize)
    return total


def sharded_batch(trainer: Trainer) -> Any:
    """The batch's abstract arrays, each with its sharding."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        trainer.batch_abstract,
        trainer.batch_shardings,
    )


def state_and_batch(trainer: Trainer) -> tuple[int, int]:
    """Exact bytes per device of the train state and of the batch (their shardings)."""
    state = tree_bytes_per_device(trainer.abstract_state())
    return state, tree_bytes_per_device(sharded_batch(trainer))


def gathered_layer_bytes(trainer: Trainer) -> int:
    """Bytes per device of the layers' weights gathered over the batch's mesh axes (FSDP:
    `collectives.zero3` gathers each kernel inside its layer), 0 where no layer weight is split
    over them: every unrolled layer's (`layers_N` paths), and of scanned stacks (a `layers`
    dimension) one layer's, the largest stack's. A layer loop gathers the layer in hand's
    weights in its body and frees them there, and the stacks' loops run one after another
    (XLA:TPU's buffer assignments of the test-size scanned FSDP programs, v5e and v5p, `none`
    and `full`: each kernel gathered just before its dot, one or two live at once in one
    reused buffer, never the next layer's or the stack's). In the parameters' dtype, as the
    unrolled TPU terms were fitted (XLA:TPU gathers its dots' bf16 operands, fp32 policy too)."""
    part = trainer.partitioner
    batch_axes = set(part.batch_axes)
    unrolled = 0
    one_layer: dict[str, int] = {}  # a scanned stack's one layer, by stack
    for (path, x), (s, names) in zip(
        jax.tree_util.tree_leaves_with_path(trainer.state_abstract.params), param_specs(trainer)
    ):
        # Experts split over the batch's axes are not gathered: their tokens come to them.
        axes = [t for e, n in zip(s.spec, names) if n != "expert" for t in mesh_axes_of(e)]
        scanned = "layers" in names
        if not (scanned or "layers_" in jax.tree_util.keystr(path)) or not batch_axes & set(axes):
            continue
        split = math.prod(
            part.mesh.shape[t]
            for e, n in zip(s.spec, names)
            for t in mesh_axes_of(e)
            if t not in batch_axes or n == "expert"
        )
        size = math.prod(x.shape) * np.dtype(x.dtype).itemsize // split
        if scanned:
            stack = jax.tree_util.keystr(path[:1])
            one_layer[stack] = one_layer.get(stack, 0) + size // x.shape[names.index("layers")]
        else:
            unrolled += size
    return unrolled + max(one_layer.values(), default=0)


def embedding_gradient_bytes(trainer: Trainer, min_itemsize: int = 0) -> tuple[int, int]:
    """(unreduced, reduced) bytes per device of the token embedding's gradient."""
    part = trainer.partitioner
    batch_axes = set(part.batch_axes)
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(trainer.state_abstract.params),
        jax.tree_util.tree_leaves(trainer.state_shardings.params),
    ):
        if "token_embedder" in jax.tree_util.keystr(path):
            whole = math.prod(x.shape) * max(np.dtype(x.dtype).itemsize, min_itemsize)
            axes = [t for e in s.spec for t in mesh_axes_of(e)]
            unreduced = math.prod(part.mesh.shape[t] for t in axes if t not in batch_axes)
            reduced = math.prod(part.mesh.shape[t] for t in axes)
            return whole // unreduced, whole // reduced
    return 0, 0


def gradient_bytes(
    trainer: Trainer, min_itemsize: int = 0, scan_reduces: bool = True
) -> tuple[int, int]:
    """(all, the scanned stacks' part) gradient bytes per device as the backward pass holds
    them, each element at least `min_itemsize` bytes (XLA:CPU differentiates bf16 masters in
    fp32): whole over the batch's mesh axes until the reduction, except a scanned stack's layer
    gradients, which the layer scan reduces (FSDP: reduce-scatters) one layer at a time into
    the parameters' sharding."""
    scanned = scan_reduces and trainer.model.network_config.scan_layers
    total = sum(
        unreduced
        for _, names, unreduced, _, _ in gradient_leaves(trainer, min_itemsize)
        if not (scanned and "layers" in names)
    )
    if not scanned:
        return total, 0
    reduced, in_hand = layer_gradient_bytes(trainer, min_itemsize)
    return total + reduced + in_hand, reduced + in_hand


def layer_gradient_bytes(
    trainer: Trainer, min_itemsize: int = 0, stack: str = ""
) -> tuple[int, int]:
    """(reduced, in hand) bytes per device of the scanned stacks' layer gradients (of one
    `stack`, 'encoder' or 'decoder', if named): all of them in the parameters' sharding, and
    the largest stack's one layer whole over the batch's axes (the layer scan's in hand,
    before its reduction; 0 where nothing splits them over the batch's axes)."""
    reduced = 0
    in_hand: dict[str, int] = {}
    for path, names, unreduced, size, layers in gradient_leaves(trainer, min_itemsize):
        if "layers" not in names or (stack and f"'{stack}'" not in jax.tree_util.keystr(path)):
            continue
        reduced += size
        if size != unreduced:
            key = jax.tree_util.keystr(path[:1])
            in_hand[key] = in_hand.get(key, 0) + unreduced // layers
    return reduced, max(in_hand.values(), default=0)


def gradient_leaves(trainer: Trainer, min_itemsize: int) -> Iterator[tuple]:
    """Each parameter's path, logical names, gradient bytes per device unreduced (whole over
    the batch's axes) and reduced (in the parameters' sharding), and its `layers` size (or 1)."""
    part = trainer.partitioner
    batch_axes = set(part.batch_axes)
    for (path, x), (s, names) in zip(
        jax.tree_util.tree_leaves_with_path(trainer.state_abstract.params), param_specs(trainer)
    ):
        # An expert kernel's `expert` dimension keeps its split even over the batch's axes: its
        # tokens come to it (the dispatch's all-to-all), its gradient is local.
        local = [mesh_axes_of(e) for e, n in zip(s.spec, names) if n == "expert"]
        size = math.prod(x.shape) * max(np.dtype(x.dtype).itemsize, min_itemsize)
        unsplit = [t for e in s.spec for t in mesh_axes_of(e)]
        unreduced = size // math.prod(
            part.mesh.shape[t] for t in unsplit if t not in batch_axes or any(t in a for a in local)
        )
        reduced = size // math.prod(part.mesh.shape[t] for t in unsplit)
        layers = x.shape[names.index("layers")] if "layers" in names else 1
        yield path, names, unreduced, reduced, layers


def param_specs(trainer: Trainer) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """Each parameter's sharding and logical axis names, in the parameters' leaf order."""
    yield from zip(
        jax.tree_util.tree_leaves(trainer.state_shardings.params),
        (
            tuple(n)
            for n in jax.tree_util.tree_leaves(
                trainer.params_axes, is_leaf=lambda n: isinstance(n, P)
            )
        ),
    )


def params_split_over_batch(trainer: Trainer) -> bool:
    """Whether any parameter is split over the batch's mesh axes (FSDP, fully sharded: gathered
    where used), experts' own dimension aside."""
    batch_axes = set(trainer.partitioner.batch_axes)
    return any(
        batch_axes & set(mesh_axes_of(e))
        for s, names in param_specs(trainer)
        for e, n in zip(s.spec, names)
        if n != "expert"
    )
