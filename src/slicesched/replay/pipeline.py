"""A pipeline-parallel replica's stages: which micro-batch each runs and which wait for it.

A micro-batch (one engine batch) runs stage by stage, each stage's part a GMG iteration of its
own on that stage's group (`gmg.stages.build_stages`). A stage runs one micro-batch at a
time, in arrival order (a GPU runs the forward passes handed to it in order; in the simulator
two iterations on one group would take turns slice by slice instead). Between stages the
hidden states move over the link connecting the two groups. The engine keeps up to pp
micro-batches in flight with disjoint requests (vLLM's virtual engines); a new one starts
when stage 0 can take it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slicesched.gmg.ops import IterationGraph
from slicesched.hardware.specs import LinkSpec
from slicesched.serving import Batch


@dataclass(slots=True, eq=False)
class MicroBatch:
    """One engine batch on its way through the stages."""

    batch: Batch
    graphs: tuple[IterationGraph, ...]  # one per stage
    stage: int = 0  # the stage it runs on or waits for


@dataclass(slots=True, eq=False)
class Pipeline:
    """Per stage, the micro-batch running there and those queued for it (FIFO)."""

    groups: tuple[int, ...]  # device group of each stage
    links: tuple[LinkSpec, ...]  # link from each stage to the next (pp - 1)
    running: list[MicroBatch | None] = field(init=False)
    waiting: list[deque[MicroBatch]] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.links) != len(self.groups) - 1:
            raise ValueError(f"{len(self.groups)} stages need {len(self.groups) - 1} links, got {len(self.links)}")
        self.running = [None] * len(self.groups)
        self.waiting = [deque() for _ in self.groups]

    @property
    def pp(self) -> int:
        return len(self.groups)

    def can_start(self) -> bool:
        """Stage 0 can take a new micro-batch now."""
        return self.running[0] is None and not self.waiting[0]

    def arrive(self, mb: MicroBatch, stage: int) -> bool:
        """`mb` reached `stage` (formed, or its activations landed); True if it runs there now."""
        mb.stage = stage
        if self.running[stage] is None:
            self.running[stage] = mb
            return True
        self.waiting[stage].append(mb)
        return False

    def leave(self, stage: int) -> MicroBatch | None:
        """The micro-batch on `stage` finished there; returns the next one to run on it, if any."""
        self.running[stage] = None
        if self.waiting[stage]:
            nxt = self.running[stage] = self.waiting[stage].popleft()
            return nxt
        return None
