"""The train loop's documented order (`t5lite.programs.train_loop`), with a fake step: metrics
hooks run a step late unless a state hook is due or the step is the last, the stop hook and each
`due` are asked once per step, the next batch is put after the previous step's metrics hooks,
and each step's info is yielded after its state hooks."""

from __future__ import annotations

import numpy as np

from t5lite.programs.train_loop import Batches, LoopConfig, StepInfo, StepMetrics, TrainLoop


class _Data:
    def __init__(self, events):
        self.events, self.i = events, 0

    def __next__(self):
        self.i += 1
        self.events.append(f"put {self.i}")
        return {"x": np.array([self.i])}

    def get_state(self):
        return {"i": self.i}


def _metrics(loss):
    return {
        "loss_sum": np.float32(loss),
        "weight_sum": np.float32(1.0),
        "correct_sum": np.float32(0.0),
        "params_finite": np.array([True]),
    }


class _Save:
    def __init__(self, events, every):
        self.events, self.every = events, every

    def due(self, info: StepInfo) -> bool:
        self.events.append(f"due? {info.step}")
        return info.last or info.step % self.every == 0

    def __call__(self, info: StepInfo) -> None:
        self.events.append(f"save {info.step} data {info.data_state['i']}")


def test_hooks_run_in_the_documented_order_and_the_info_is_yielded_after_them():
    events: list[str] = []

    def step(state, batch):
        events.append(f"dispatch {state + 1} (batch {int(batch['x'][0])})")
        return state + 1, _metrics(float(state + 1))

    def stop(step):
        events.append(f"stop? {step}")
        return step == 4  # a preemption at step 4

    loop = TrainLoop(step, Batches(_Data(events), lambda local: local), LoopConfig(0, 10))
    loop.add_hook(lambda m: events.append(f"read {m.step} loss {m.values['loss']:g}"))
    seen: list[StepMetrics] = []
    loop.add_hook(seen.append, every=3)
    loop.add_stop_hook(stop)
    loop.add_state_hook(_Save(events, every=2))
    for info in loop.steps(0):
        events.append(f"yield {info.step}")
    assert events == [
        "put 1",
        "dispatch 1 (batch 1)",
        "stop? 1",
        "due? 1",
        "put 2",
        "yield 1",
        "dispatch 2 (batch 2)",
        "read 1 loss 1",
        "stop? 2",
        "due? 2",
        "put 3",
        "read 2 loss 2",
        "save 2 data 2",
        "yield 2",
        "dispatch 3 (batch 3)",
        "stop? 3",
        "due? 3",
        "put 4",
        "yield 3",
        "dispatch 4 (batch 4)",
        "read 3 loss 3",
        "stop? 4",
        "due? 4",
        "read 4 loss 4",
        "save 4 data 4",
        "yield 4",
    ]
    # every=3: step 3, and the last step whatever its number.
    assert [(m.step, m.last) for m in seen] == [(3, False), (4, True)]
    assert info.preempted and info.last and not info.final and info.state == 4


def test_the_final_step_and_stop_after_steps_end_the_loop():
    def step(state, batch):
        return state + 1, _metrics(1.0)

    for config, steps, final, stopping in [
        (LoopConfig(5, 8), [6, 7, 8], True, False),
        (LoopConfig(5, 100, stop_after_steps=2), [6, 7], False, True),
    ]:
        loop = TrainLoop(step, Batches(_Data([]), lambda local: local), config)
        infos = list(loop.steps(config.start))
        assert [i.step for i in infos] == steps
        assert (infos[-1].final, infos[-1].stopping) == (final, stopping)
        assert not any(i.last for i in infos[:-1])
