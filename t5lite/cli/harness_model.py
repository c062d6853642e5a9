"""`t5lite` as an lm-evaluation-harness model name: a checkpoint and the gin files of its model.

Importing this module registers it (lm-eval finds no models outside its own package by itself):

    import t5lite.cli.harness_model
    lm_eval.simple_evaluate(model="t5lite",
        model_args="checkpoint=OUT/checkpoint_0,gin_file=OUT/model.gin", tasks=[...])

`gin_file` is one file or several joined by `+`; they must set `MODEL` (the model.gin that
`t5lite convert` writes does) and may bind `Partitioner` (the mesh; default: data parallel on
every device). The vocabulary is the model's own (`harness_tokens.find_tokens`).
"""

from __future__ import annotations

from typing import Any

import gin
from lm_eval.api.registry import register_model

from t5lite.cli import gin_config
from t5lite.programs import harness
from t5lite.programs.harness_lm import T5LiteLM
from t5lite.programs.harness_tokens import find_tokens


@register_model("t5lite")
class T5LiteHarnessLM(T5LiteLM):
    """`--model t5lite --model_args checkpoint=DIR,gin_file=A.gin[+B.gin][,tokenizer=DIR]
    [,batch_size=N][,max_length=N][,max_gen_toks=N][,num_partitions=N][,seed=N]`; `seed` makes
    sampled generation (`do_sample: true`) reproducible."""

    def __init__(
        self,
        checkpoint: str,
        gin_file: str = "",
        tokenizer: str | None = None,
        batch_size: int | str | None = 8,
        max_length: int = 512,
        max_gen_toks: int = 256,
        num_partitions: int | None = None,
        seed: int = 0,
        **unused: Any,  # lm-eval's device, max_batch_size, ...: the mesh decides
    ):
        from t5lite.cli import registry

        files = [f for f in gin_file.split("+") if f]
        if not files:
            raise ValueError("model_args gin_file=...: the gin file(s) that set MODEL")
        bindings = [f"Partitioner.num_partitions={num_partitions}"] if num_partitions else []
        gin_config.parse_gin(files, bindings)
        model = gin.query_parameter("%MODEL").scoped_configurable_fn()
        partitioner = registry.Partitioner()
        config = harness.HarnessConfig(
            tasks=(),
            batch_size=int(batch_size) if str(batch_size).isdigit() else 8,
            max_length=int(max_length),
            max_gen_toks=int(max_gen_toks),
            tokenizer=tokenizer,
        )
        params = harness.restore_params(model, partitioner, checkpoint, config.batch_size)
        tokens = find_tokens(model, checkpoint, tokenizer=tokenizer)
        super().__init__(
            model,
            params,
            tokens,
            partitioner=partitioner,
            batch_size=config.batch_size,
            max_length=config.max_length,
            max_gen_toks=config.max_gen_toks,
            seed=int(seed),
        )
