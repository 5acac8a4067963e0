"""Per-tenant continuous batching (vLLM-style iteration-level scheduling).

A driver (the simulator or the real executor) owns the clock and the devices; a ``TenantEngine``
owns one tenant's queues and KV blocks. The protocol, per tenant:

    engine.add_request(req, now)          # when the request arrives
    batch = engine.next_batch(now)        # when the tenant can start an iteration; None = nothing
    ...driver runs the batch's iteration...
    done = engine.on_batch_done(batch, now)  # when it completed; returns requests that finished
    engine.preempt_all(now)               # instead of on_batch_done, when the device reported OOM

Scheduling in ``next_batch`` (vLLM v1 + Sarathi chunked prefill):

1. running requests in their decode phase get one token each, oldest arrival first; when the KV
   pool cannot grow one, the most recently arrived running request not yet in this batch is
   preempted by recomputation (blocks freed, back to the waiting queue's front, prefill restarts);
   if that is the request itself it preempts itself;
2. running requests part-way through a chunked prefill get their next chunk from the remaining
   token budget, with the same preemption rule;
3. waiting requests are admitted first-come first-served while ``max_num_seqs``, the token budget
   and the free blocks allow; admission never preempts, and stops at the first request that does
   not fit (no overtaking). Without chunked prefill a request needs its whole prefill in one batch.
   With ``ttft_plan`` set (a request's TTFT deadline and its prefill time alone), the order
   maximizes the requests that meet their deadline instead (Moore-Hodgson on one machine):
   preempted requests, then earliest deadline first among those that can still make it given
   the prefill work ahead of them, then the rest, which would miss anyway (serving them first
   would only make others late too); and a request joins an iteration only if the iteration,
   longer by its chunk, still ends before the deadline of every first token it carries.

Per-iteration work is O(running requests + batch), no pandas, no numpy in the loop.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field
from itertools import compress
from typing import Callable

import numpy as np

from slicesched.serving.kv_cache import KVBlockManager
from slicesched.serving.request import Request, RequestState


@dataclass(frozen=True, slots=True)
class Batch:
    """One iteration of one tenant: what the graph builder turns into ops.

    Entry ``i`` computes ``num_new_tokens[i]`` tokens of request ``req_ids[i]`` on top of
    ``context_lens_before[i]`` tokens already in its KV cache; attention for it spans
    ``context_lens[i] = context_lens_before[i] + num_new_tokens[i]`` keys. ``is_prefill[i]`` is
    False exactly for single-token decode steps.
    """

    tenant: str
    iteration: int
    req_ids: tuple[int, ...]
    num_new_tokens: tuple[int, ...]
    context_lens_before: tuple[int, ...]
    is_prefill: tuple[bool, ...]
    num_prefill_tokens: int = field(init=False)
    num_decode_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        n = len(self.req_ids)
        if not (len(self.num_new_tokens) == len(self.context_lens_before) == len(self.is_prefill) == n):
            raise ValueError("Batch entry tuples must have equal lengths")
        pre = sum(compress(self.num_new_tokens, self.is_prefill))  # (no generator: one per iteration)
        object.__setattr__(self, "num_prefill_tokens", pre)
        object.__setattr__(self, "num_decode_tokens", sum(self.num_new_tokens) - pre)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def num_seqs(self) -> int:
        return len(self.req_ids)

    @property
    def context_lens(self) -> np.ndarray:
        """Total context (keys) each entry attends over after this step, int64."""
        return np.add(self.context_lens_before, self.num_new_tokens, dtype=np.int64)


class _Draft:
    """The batch being assembled inside one ``next_batch`` call."""

    __slots__ = ("ids", "new", "ctx", "pre", "budget")

    def __init__(self, budget: int) -> None:
        self.ids: list[int] = []
        self.new: list[int] = []
        self.ctx: list[int] = []
        self.pre: list[bool] = []
        self.budget = budget

    def add(self, req: Request, n: int, prefill: bool) -> None:
        self.ids.append(req.id)
        self.new.append(n)
        self.ctx.append(req.num_computed_tokens)
        self.pre.append(prefill)
        self.budget -= n


def _arrival_key(req: Request) -> tuple[float, int]:
    return (req.arrival_s, req.id)


class TenantEngine:
    """Queues, KV blocks and batch formation for one tenant; see the module docstring."""

    def __init__(self, tenant: str, kv: KVBlockManager, max_batch_tokens: int, max_num_seqs: int,
                 chunked_prefill: bool = True, *, max_inflight_batches: int = 1,
                 max_model_len: int | None = None) -> None:
        """``max_model_len`` caps prompt + output tokens of one request (vLLM's meaning): a longer
        prompt is refused, a longer output is cut there (``Request.truncated``). It defaults to
        the KV pool's size, and without chunked prefill also to ``max_batch_tokens``, because a
        request must be able to run alone or its prefill to fit one batch, or it would never end.
        """
        if max_batch_tokens < 1 or max_num_seqs < 1 or max_inflight_batches < 1:
            raise ValueError("max_batch_tokens, max_num_seqs, max_inflight_batches must be >= 1")
        limit = kv.capacity_tokens if chunked_prefill else min(kv.capacity_tokens, max_batch_tokens)
        if max_model_len is None:
            max_model_len = limit
        if not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] (KV pool"
                             f"{'' if chunked_prefill else ' and max_batch_tokens'}), got {max_model_len}")
        self.tenant = tenant
        self.kv = kv
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.max_inflight_batches = max_inflight_batches
        self.max_model_len = max_model_len
        self.decode_batch_tokens: int | None = None  # token budget of an iteration carrying decodes (None: max_batch_tokens)
        self.ttft_plan: Callable[[Request], tuple[float, float]] | None = None  # set: deadline-aware order (step 3)
        self._plan: dict[int, tuple[float, float]] = {}  # request id -> ttft_plan, computed once per live request
        self.num_preemptions = 0  # all preemptions, KV pressure and OOM
        self.num_oom_preemptions = 0  # those caused by preempt_all
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # sorted by (arrival_s, id)
        self._live: dict[int, Request] = {}  # every unfinished request, by id
        self._inflight: dict[int, Batch] = {}  # by iteration index
        self._busy: set[int] = set()  # ids in some in-flight batch
        self._stopping: dict[int, bool] = {}  # id -> cancelled, of requests stopped while in a batch in flight
        self._iteration = 0

    # ---- driver interface -------------------------------------------------------------------

    def add_request(self, req: Request, now: float) -> None:
        """Queue a newly arrived request (the driver calls this at its arrival time ``now``)."""
        if req.tenant != self.tenant:
            raise ValueError(f"request {req.id} of tenant {req.tenant!r} sent to engine {self.tenant!r}")
        if req.id in self._live:
            raise ValueError(f"request {req.id} already queued in engine {self.tenant!r}")
        if req.prompt_tokens > self.max_model_len:
            raise ValueError(f"request {req.id}: prompt of {req.prompt_tokens} tokens exceeds "
                             f"max_model_len {self.max_model_len}")
        if req.state is not RequestState.WAITING or req.num_computed_tokens or req.num_generated:
            raise ValueError(f"request {req.id} is not fresh (state {req.state})")
        self._live[req.id] = req
        self._waiting.append(req)

    def takes_prompt(self, prompt_tokens: int) -> bool:
        """Can a prompt this long be served here: shorter than `max_model_len`, leaving room
        for at least one output token? (The driver refuses an arrival that is not.)"""
        return prompt_tokens < self.max_model_len

    def live_request(self, rid: int) -> Request | None:
        """The request `rid` this engine holds (waiting, running or in a batch in flight), if any."""
        return self._live.get(rid)

    def has_work(self) -> bool:
        """True while some request is waiting or running (in flight or not)."""
        return bool(self._waiting) or bool(self._running)

    def next_batch(self, now: float) -> Batch | None:
        """Form the next iteration, or None when nothing can run now.

        The driver calls it whenever the tenant may start an iteration: after ``on_batch_done``,
        after an arrival while idle, or (with ``max_inflight_batches`` > 1) while other batches
        of this tenant are still running. Requests in an in-flight batch are skipped.
        """
        if len(self._inflight) >= self.max_inflight_batches:
            return None
        draft = _Draft(self.max_batch_tokens)
        saw_prefill = self._schedule_decodes(draft)
        if draft.ids and self.decode_batch_tokens is not None:
            # Sarathi-Serve's stall-free batching: prefill work riding with decodes is capped so the
            # decodes' step stays short; a quarter of the budget always goes to prefills (no starving)
            cap = self.decode_batch_tokens
            draft.budget = min(draft.budget, max(cap - len(draft.ids), cap // 4))
        if saw_prefill:
            self._schedule_prefill_chunks(draft)
        self._admit_waiting(draft, now)
        if not draft.ids:
            return None
        self._iteration += 1
        batch = Batch(self.tenant, self._iteration, tuple(draft.ids), tuple(draft.new),
                      tuple(draft.ctx), tuple(draft.pre))
        self._inflight[batch.iteration] = batch
        self._busy.update(draft.ids)
        return batch

    def on_batch_done(self, batch: Batch, now: float, tokens: tuple[int, ...] | None = None) -> list[Request]:
        """Apply a completed batch at time ``now``; return the requests it finished.

        The driver calls it once per batch when the iteration's last op completes. Prefill chunks
        advance; the step that completes a request's pending tokens emits one token at ``now``:
        where the backend computed them, ``tokens[i]`` (entry i's next token) is the one emitted
        (appended to ``Request.output_ids``). A batch dropped by ``preempt_all`` is ignored (returns []).
        """
        if batch.tenant != self.tenant:
            raise ValueError(f"batch of tenant {batch.tenant!r} returned to engine {self.tenant!r}")
        if self._inflight.pop(batch.iteration, None) is None:
            return []
        finished: list[Request] = []
        live, busy = self._live, self._busy
        for j, (rid, n) in enumerate(zip(batch.req_ids, batch.num_new_tokens)):
            busy.discard(rid)
            req = live[rid]
            req.num_computed_tokens += n
            if req.prefix_keys:  # its blocks filled by this step are cached for others
                self.kv.commit_prefix(rid, req.prefix_keys, req.num_computed_tokens)
            if req.num_computed_tokens < req.prompt_tokens + req.num_generated:
                continue  # a prefill chunk short of the end emits nothing
            req.emit_token(now)
            if tokens is not None:
                req.output_ids.append(tokens[j])
            if (req.num_generated >= req.output_tokens
                    or req.prompt_tokens + req.num_generated > self.max_model_len):
                self._finish(req, now)
                finished.append(req)
        for rid in [r for r in batch.req_ids if r in self._stopping] if self._stopping else ():
            cancelled, req = self._stopping.pop(rid), live.get(rid)
            if req is not None:  # not finished by this step anyway
                self._end(req, now, cancelled)
                finished.append(req)
        if finished:
            self._running = [r for r in self._running if r.state is RequestState.RUNNING]
        return finished

    def stop(self, req_id: int, now: float, cancelled: bool = False) -> bool:
        """End a live request before its `output_tokens` (live serving: it emitted an
        end-of-sequence or stop token, or, `cancelled`, its client went away). Its KV blocks are
        freed now, or when the batch in flight that holds it is done. False if it is not live."""
        req = self._live.get(req_id)
        if req is None:
            return False
        if req_id in self._busy:
            self._stopping[req_id] = cancelled
        else:
            self._end(req, now, cancelled)
        return True

    def _end(self, req: Request, now: float, cancelled: bool) -> None:
        if req.state is RequestState.RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        req.output_tokens = max(req.num_generated, 1)  # what it was: the engine learns the end now
        self._finish(req, now)
        if cancelled:
            req.state = RequestState.CANCELLED

    def preempt_all(self, now: float) -> int:
        """Preempt every running request by recomputation; returns how many.

        The driver calls it when the tenant's device reported an OOM: in-flight batches are
        dropped (their ``on_batch_done`` becomes a no-op) and their progress is lost.
        """
        self._inflight.clear()
        self._busy.clear()
        for rid, cancelled in self._stopping.items():  # their batches are dropped: they end now
            self._end(self._live[rid], now, cancelled)
        self._stopping.clear()
        n = len(self._running)
        for i in range(n - 1, -1, -1):  # newest first, so the oldest ends up at the queue front
            self._preempt(i)
        self.num_oom_preemptions += n
        return n

    def take_waiting(self, max_n: int) -> list[Request]:
        """Hand over up to ``max_n`` never-admitted requests from the back of the queue (the
        newest), for another replica of the tenant to serve. Requests already started stay."""
        out: list[Request] = []
        while self._waiting and len(out) < max_n:
            req = self._waiting[-1]
            if req.state is not RequestState.WAITING:
                break
            self._waiting.pop()
            del self._live[req.id]
            self._plan.pop(req.id, None)
            out.append(req)
        out.reverse()
        return out

    def evict_all(self, now: float) -> list[Request]:
        """Give up every unfinished request (the replica is going away): running ones are
        preempted by recomputation first. In-flight batches are dropped. Returns them in
        arrival order, ready for another replica's ``adopt``."""
        self.preempt_all(now)
        return self._give_up_waiting()

    def _give_up_waiting(self) -> list[Request]:
        """Empty the queue and forget every request (nothing runs any more): the waiting ones in
        arrival order."""
        out = sorted(self._waiting, key=_arrival_key)
        self._waiting.clear()
        self._live.clear()
        self._plan.clear()
        return out

    def hand_over(self, before_free: "Callable[[Request], None] | None" = None) -> list[Request]:
        """Give up every unfinished request with its progress (the replica is going away and its
        KV cache moves to another replica, see `adopt_running`): in-flight batches are dropped
        (their progress is lost), blocks freed here, each running request passed to
        `before_free` first (its blocks still held). Returns running requests, then waiting
        ones, each in arrival order."""
        self._inflight.clear()
        self._busy.clear()
        running, self._running = self._running, []
        for r in running:
            if before_free is not None:
                before_free(r)
            self.kv.free(r.id)
        return running + self._give_up_waiting()

    def hand_over_decoding(self, take: "Callable[[Request], bool]") -> list[Request]:
        """Give up the running requests past their prompt, in no batch in flight, that `take`
        accepts (called with their blocks still held, so it can copy their KV out): a replica
        that serves prompts only sends each home to decode (`adopt_running` there). Returns them."""
        out, keep = [], []
        for r in self._running:
            moved = not r.in_prefill and r.id not in self._busy and r.id not in self._stopping and take(r)
            (out if moved else keep).append(r)
        if out:
            self._running = keep
            for r in out:
                self.kv.free(r.id)
                del self._live[r.id]
                self._plan.pop(r.id, None)
        return out

    def adopt_running(self, req: Request, now: float) -> bool:
        """Take over a running request whose KV cache was moved here from another replica: its
        computed tokens need blocks here. False (nothing changed) when no seat or blocks are free."""
        if req.tenant != self.tenant or req.id in self._live or req.state is not RequestState.RUNNING:
            raise ValueError(f"request {req.id} cannot be adopted running by engine {self.tenant!r}")
        if len(self._running) >= self.max_num_seqs or not self.kv.allocate(req.id, req.num_computed_tokens):
            return False
        self._live[req.id] = req
        bisect.insort(self._running, req, key=_arrival_key)
        return True

    def adopt(self, req: Request, now: float) -> None:
        """Take over a request another replica gave up (fresh or preempted: no KV held here).
        It queues in arrival order among waiting requests, as it would have arrived here."""
        if req.tenant != self.tenant or req.id in self._live:
            raise ValueError(f"request {req.id} cannot be adopted by engine {self.tenant!r}")
        if req.num_computed_tokens or req.state not in (RequestState.WAITING, RequestState.PREEMPTED):
            raise ValueError(f"request {req.id} still holds KV elsewhere (state {req.state})")
        self._live[req.id] = req
        i = len(self._waiting)
        while i > 0 and _arrival_key(self._waiting[i - 1]) > _arrival_key(req):
            i -= 1
        self._waiting.insert(i, req)

    # ---- introspection ----------------------------------------------------------------------

    def request(self, req_id: int) -> Request:
        """An unfinished request of this engine (real serving reads its token ids)."""
        return self._live[req_id]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def prefill_backlog(self) -> list[tuple[float, int, int]]:
        """(arrival, prompt tokens, prompt tokens left to compute) of every request still waiting
        for its first token, in the order it will be served (running ones first, then the
        queue): what a predicted-TTFT signal needs."""
        out = [(r.arrival_s, r.prompt_tokens, r.prompt_tokens - r.num_computed_tokens)
               for r in self._running if r.num_generated == 0]
        out += [(r.arrival_s, r.prompt_tokens, r.prompt_tokens) for r in self._waiting]
        return out

    @property
    def iteration(self) -> int:
        """Index of the last batch formed (batches are numbered from 1)."""
        return self._iteration

    # ---- scheduling steps -------------------------------------------------------------------

    def _schedule_decodes(self, draft: _Draft) -> bool:
        """One token for each running request in its decode phase, oldest first, preempting on
        KV need. Returns whether a running request part-way through its prefill was skipped.

        This loop runs over every running request every iteration: it is the hot path, hence
        the inlined phase test and the direct list appends.
        """
        running, busy, kv = self._running, self._busy, self.kv
        ids, new, ctx, pre = draft.ids, draft.new, draft.ctx, draft.pre
        saw_prefill = False
        i = 0
        while i < len(running) and draft.budget > 0:
            req = running[i]
            computed, generated = req.num_computed_tokens, req.num_generated
            if req.id in busy:
                i += 1
            elif generated == 0 or computed < req.prompt_tokens + generated - 1:
                saw_prefill = True
                i += 1
            elif kv.allocate(req.id, computed + 1) or self._reserve(i, computed + 1, draft):
                ids.append(req.id)
                new.append(1)
                ctx.append(computed)
                pre.append(False)
                draft.budget -= 1
                i += 1
            # else: running[i] preempted itself; the next request now sits at index i
        return saw_prefill

    def _schedule_prefill_chunks(self, draft: _Draft) -> None:
        """Next chunk for running requests part-way through a (chunked) prefill, oldest first,
        from the token budget the decodes left; same preemption rule as decodes."""
        running, busy = self._running, self._busy
        i = 0
        while i < len(running) and draft.budget > 0:
            req = running[i]
            if req.id in busy or not req.in_prefill:
                i += 1
                continue
            n = self._chunk(req.num_tokens - req.num_computed_tokens, draft.budget)
            if n == 0:
                i += 1
            elif self._reserve(i, req.num_computed_tokens + n, draft):
                draft.add(req, n, prefill=True)
                i += 1

    def _admit_waiting(self, draft: _Draft, now: float) -> None:
        """Admit waiting requests in queue order (FCFS, or deadline-aware) while seats, token
        budget and free blocks allow."""
        waiting = self._waiting
        if self.ttft_plan is None:
            while waiting and self._admit(waiting[0], draft, now):
                waiting.popleft()
            return
        if not waiting or draft.budget <= 0 or len(self._running) >= self.max_num_seqs:
            return  # nothing could be admitted: no order to plan
        end, due = self._draft_timing(draft, now)
        admitted: set[int] = set()
        for req in self._deadline_order(now):
            n = self._chunk(req.num_tokens, draft.budget)
            longer = self._prefill_s(req, n)
            # a longer iteration delays every first token in it: none may be pushed past its deadline
            if draft.ids and end + longer > due:
                break
            if not self._admit(req, draft, now, n):
                break
            admitted.add(req.id)
            end += longer
            deadline = self._plan[req.id][0]
            if req.num_computed_tokens + draft.new[-1] == req.num_tokens and deadline >= end:
                due = min(due, deadline)
        if admitted:
            self._waiting = deque(r for r in waiting if r.id not in admitted)

    def _draft_timing(self, draft: _Draft, now: float) -> tuple[float, float]:
        """(predicted end, earliest deadline it must meet) of the draft's prefill work: its chunks
        at their requests' isolated prefill rates from `now`; the deadline of those whose first
        token it emits and who can still make it."""
        end, due, firsts = now, float("inf"), []
        for rid, n, ctx, pre in zip(draft.ids, draft.new, draft.ctx, draft.pre):
            req = self._live[rid]
            if not pre or req.num_generated:
                continue
            end += self._prefill_s(req, n)
            if ctx + n >= req.prompt_tokens:
                firsts.append(self._plan[req.id][0])
        for d in firsts:
            if d >= end:
                due = min(due, d)
        return end, due

    def _deadline_order(self, now: float) -> list[Request]:
        """Waiting requests in the order that lets the most meet their TTFT deadline: preempted
        ones first (they started once), then Moore-Hodgson over the fresh ones (earliest deadline
        first; whenever the running total of prefill time from `now`, after the prefills already
        running, passes a deadline, the longest prefill taken so far is moved to the late tail),
        then the late tail by deadline."""
        for r in self._waiting:
            self._plan_of(r)
        plan = self._plan
        first = [r for r in self._waiting if r.state is RequestState.PREEMPTED]
        fresh = sorted((r for r in self._waiting if r.state is not RequestState.PREEMPTED),
                       key=lambda r: (plan[r.id][0], r.id))
        t = now + sum(plan[r.id][1] for r in first)
        for r in self._running:  # the prefills already running go first
            if r.in_prefill:
                t += self._prefill_s(r, r.prompt_tokens - r.num_computed_tokens)
        taken: list[tuple[float, int]] = []  # max-heap of (-alone, id) among the on-time set
        late: set[int] = set()
        for r in fresh:
            deadline, alone = plan[r.id]
            heapq.heappush(taken, (-alone, r.id))
            t += alone
            if t > deadline:
                neg, rid = heapq.heappop(taken)
                t += neg
                late.add(rid)
        return first + [r for r in fresh if r.id not in late] + [r for r in fresh if r.id in late]

    def _plan_of(self, req: Request) -> tuple[float, float]:
        """`ttft_plan` of a live request, computed once."""
        got = self._plan.get(req.id)
        if got is None:
            got = self._plan[req.id] = self.ttft_plan(req)
        return got

    def _prefill_s(self, req: Request, tokens: int) -> float:
        """Seconds of `tokens` of the request's prefill at its isolated rate (`ttft_plan`)."""
        return self._plan_of(req)[1] * tokens / max(req.prompt_tokens, 1)

    def _admit(self, req: Request, draft: _Draft, now: float, n: int | None = None) -> bool:
        """Admit one request into the draft, with its chunk `n` (default: what the budget
        allows), if a seat, the budget and free blocks allow."""
        if draft.budget <= 0 or len(self._running) >= self.max_num_seqs:
            return False
        hit = self.kv.acquire_prefix(req.id, req.prefix_keys, req.num_tokens) if req.prefix_keys else 0
        rest = req.num_tokens - hit  # a cached prefix is not computed again
        n = self._chunk(rest, draft.budget) if n is None else min(n, rest)
        if n == 0 or not self.kv.allocate(req.id, hit + n):
            if hit:
                self.kv.free(req.id)
            return False
        req.num_computed_tokens = hit
        req.cached_tokens += hit
        req.state = RequestState.RUNNING
        if req.first_scheduled_s is None:
            req.first_scheduled_s = now
        bisect.insort(self._running, req, key=_arrival_key)
        draft.add(req, n, prefill=True)
        return True

    def _chunk(self, remaining: int, budget: int) -> int:
        """Prefill tokens to schedule now: a chunk, or all-or-nothing without chunked prefill."""
        if self.chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _reserve(self, i: int, n_tokens: int, draft: _Draft) -> bool:
        """Grow ``running[i]`` to ``n_tokens``, preempting newer requests; False if it lost its own."""
        rid = self._running[i].id
        while not self.kv.allocate(rid, n_tokens):
            victim = self._pick_victim(i, draft)
            self._preempt(victim)
            if victim == i:
                return False
        return True

    def _pick_victim(self, i: int, draft: _Draft) -> int:
        """Index of the most recently arrived running request that is neither in flight nor in
        this draft; ``running[i]`` itself qualifies, so the search always succeeds."""
        running, busy, taken = self._running, self._busy, set(draft.ids)  # preemption is rare
        for j in range(len(running) - 1, i, -1):
            rid = running[j].id
            if rid not in busy and rid not in taken:
                return j
        return i

    def _preempt(self, idx: int) -> None:
        """Preempt ``running[idx]`` by recomputation: free blocks, requeue at the front."""
        req = self._running.pop(idx)
        self.kv.free(req.id)
        req.preempt()
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    def _finish(self, req: Request, now: float) -> None:
        req.state = RequestState.FINISHED
        req.finish_s = now
        req.truncated = req.num_generated < req.output_tokens
        self.kv.free(req.id)
        del self._live[req.id]
        self._plan.pop(req.id, None)
