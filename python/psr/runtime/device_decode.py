"""The sync-free decode step: the logical caches, slot maps and counters live on the
model's device (psr_kernels.cache_state) and the host never reads them while decoding.

Per MoE layer l and decode token, in stream order:
  1. the router's logits (the model's own GEMV);
  2. one kernel (psr_kernels.decode): route biased by layer l's device membership, `use`
     (miss copy list of l), and, with n > 0 and a next MoE layer, predict + `prefetch`
     into layer l + 1 (its prefetch copy list);
  3. join: the compute stream waits for the side-stream gathers into layer l (issued by
     layer l - 1), before anything reads or rewrites l's slots;
  4. gather layer l's misses on the compute stream (mapped host rows -> slab slots);
  5. gather layer l + 1's prefetches on the side stream, forked here: it overlaps layer
     l's experts, and every earlier read of l + 1's slots is before the fork;
  6. the experts, reading their slots through the device slot map. experts_on cpu /
     hybrid: the kernel's CPU list computed from the host rows in stream order, no host
     read (`ExpertStore.cpu_experts`: x, ids, weights and the list staged to the host
     after the kernel, the CPU kernels as a host task, the sum back to the device; CUDA:
     on a host stream, overlapping the slab experts, captured by graphs); the slab
     experts skip the listed ones (slot -1 in the map: absent); the join, then the sum.
Counts accumulate in the state and are read when `stats` is read or a call ends; router
inputs that are not finite set a flag checked then (`check`). Per-token records without a
read per token: before each decode forward (`snapshot`) the counter columns of every
layer's row are copied, on the device, into the next row of a preallocated buffer (grown
on the device when full); reading the stats reads the buffer with the counts (the same
one read), and token t's record is the difference of snapshots t + 1 and t, summed over
layers: `stats.per_token` holds what the host-driven step records. A gather cannot fail
recoverably (no retries): the store's copy retries belong to the host-driven path.

The caches are handed over from the host ones when a sequence's first decode step runs
(`begin`: after prefill's copies are acquired), and back (`pull`) if a later forward of
the same sequence takes the host-driven step; `retire` tells the store what its slots
hold when the sequence ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from psr.runtime import store_ops
from psr.runtime.layer import MoELayer
from psr.runtime.step import Routed, Step, non_finite
from psr.store import cpu_kernels
from psr.store.cpu_router import cpu_cache_prefetch, cpu_cache_use, prepare_cache_use
from psr_kernels import cache_state as cs

if TYPE_CHECKING:
    from psr.runtime.context import StepContext


SNAPSHOT_ROWS = 64  # per-token snapshots held on the device before the buffer doubles
# ... up to this many: then the stats are read (one read per this many tokens), so a long
# generation's buffer stays small (4096 x layers x (counters + flag) int32).
MAX_SNAPSHOT_ROWS = 4096


class DeviceDecode(Step):
    name = "device"

    def __init__(self, runtime: StepContext) -> None:
        super().__init__(runtime)
        rt = runtime
        spec, store = rt.spec, rt.store
        self.n = rt.policy.n
        self.layout = lo = cs.CacheLayout(spec.num_experts, rt.max_capacity, spec.top_k, self.n)
        L = len(rt.layers)
        self.state = cs.new_state(L, lo, store.device)
        E, K = spec.num_experts, spec.top_k
        hdr = lo.header
        st = self.state
        # Per-layer views, made once: what the kernels and gathers address.
        self.miss_rows = [st[i, lo.miss_list : lo.miss_list + 3 * K].view(K, 3) for i in range(L)]
        self.miss_count = [st[i, hdr + cs.MISS_N : hdr + cs.MISS_N + 1] for i in range(L)]
        self.pf_rows = [st[i, lo.pf_list : lo.width].view(lo.pf_rows, 3) for i in range(L)]
        self.pf_count = [st[i, hdr + cs.PF_N : hdr + cs.PF_N + 1] for i in range(L)]
        self.slot_table = [st[i, lo.slot_of : lo.slot_of + E] for i in range(L)]
        # Misses not inserted under the miss-copy cap (experts_on cpu / hybrid), ascending.
        self.cpu_rows = [st[i, lo.cpu_list : lo.cpu_list + K] for i in range(L)]
        self.cpu_count = [st[i, hdr + cs.CPU_N] for i in range(L)]
        # The hand-off of the CPU list (None until a cpu / hybrid step needs it): per layer
        # the CPU kernels' layout of its host rows (None: a kind or format they lack), the
        # CPU result buffer, and the arguments each layer was set up with.
        self._host_layouts: list[tuple[int, ...] | None] | None = None
        self.cpu_y: list[torch.Tensor] = []
        self._handoff_set: dict[int, tuple[object, ...]] = {}
        self.slabs = [store.slab(i) for i in range(L)]
        self.store_key = store_ops.register(store)  # for the store's ops under torch.compile
        self.live = False  # the state holds the current sequence's caches
        self.pending: dict[int, torch.Tensor] = {}
        self._seen = torch.zeros(L, len(cs.COUNT_NAMES), dtype=torch.int64)
        # Each MoE layer's row bytes (a copy's), for the bytes copied: rows differ per layer
        # in a mixed GGUF file.
        self._row_bytes = torch.tensor(rt.acct.expert_bytes, dtype=torch.int64)
        # Counter columns (COUNTS .. FLAG) of every layer, one row per decode token since
        # the last read, and one more for the read itself.
        self._cols = slice(lo.header + cs.COUNTS, lo.header + cs.FLAG + 1)
        width = cs.FLAG + 1 - cs.COUNTS
        self._snaps = torch.zeros(SNAPSHOT_ROWS, L, width, dtype=st.dtype, device=st.device)
        self._n_snaps = 0
        self._times: list[float] = []  # host seconds per snapshotted token (CPU only)
        self.bad_layers: list[int] = []
        # Layers whose kernel arguments were checked (on their first call): a layer's
        # arguments keep their shapes, dtypes and devices, so later calls skip the checks.
        self.checked: set[int] = set()
        # The CPU references' cache `use` and `prefetch` as extension calls (the same row,
        # bit for bit).
        self.use_kw = (
            {"use": cpu_cache_use, "prefetch": cpu_cache_prefetch}
            if rt.ops.path == "torch" and self.state.device.type == "cpu"
            else {}
        )
        if self.use_kw:
            prepare_cache_use(self.layout)

    def hands_off(self) -> bool:
        """Whether cpu / hybrid steps hand the CPU list to the host in stream order (no
        host read: graphs can capture them): every layer's rows have CPU kernels."""
        if self._host_layouts is None:
            host = self.rt.store.host
            self._host_layouts = [c.host_layout(host(i)) for i, c in enumerate(self.rt.computes)]
        return all(lay is not None for lay in self._host_layouts)

    # --- the step --------------------------------------------------------------------
    def route(self, layer: MoELayer, x: torch.Tensor) -> Routed:
        rt = self.rt
        if x.shape[0] != 1:
            raise ValueError(f"decode steps take one token at a time, got {x.shape[0]}")
        i = layer.index
        logits = self.logits(layer, x)
        n = self.n if i + 1 < len(rt.layers) else 0
        kw = {}
        if n:
            nxt = rt.layers[i + 1]
            kw = dict(
                residual=layer.need_residual(),
                norm_weight=nxt.norm_weight,
                gate_weight=nxt.gate_weight,
                eps=nxt.norm_eps,
                next_bias=nxt.bias,
                next_gate_bias=nxt.gate_bias,
            )
        out_dtype = logits.dtype if rt.spec.weights_in_logits_dtype else torch.float32
        w, ids = rt.ops.decode_step(
            logits,
            rt.spec.route_spec(rt.steering.lam(layer)),
            self.state,
            self.layout,
            i,
            bias=layer.bias,
            out_dtype=out_dtype,
            n=n,
            checked=i in self.checked,
            capped=rt.placement.capped,
            **kw,
            **self.use_kw,
        )
        store, key, slabs = rt.store, self.store_key, self.slabs
        store_ops.join(store, key, slabs[i], i)
        store_ops.gather(store, key, slabs[i], i, self.miss_rows[i], self.miss_count[i], False)
        if n:
            rows, count = self.pf_rows[i + 1], self.pf_count[i + 1]
            store_ops.gather(store, key, slabs[i + 1], i + 1, rows, count, True)
        self.pending[i] = ids
        return self.out(logits, w, ids)

    def experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        i = layer.index
        if ids is not self.pending.pop(i, None):
            raise RuntimeError(f"MoE layer {i}: experts called without a matching route")
        y = self.rt.placement.device_experts(self, layer, x, ids, weights)
        self.checked.add(i)  # route's and this call's arguments passed their checks
        return y

    def slab_experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Every routed expert from its slab slot, through the device slot map."""
        i = layer.index
        return self.rt.computes[i].slab(
            x, self.slabs[i], ids, weights, self.slot_table[i], i in self.checked, layer.biases(ids)
        )

    def handoff_experts(
        self, layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """experts_on cpu / hybrid, handed off in stream order (no host read): the CPU
        list's experts from the host rows by the CPU kernels as a host task, the slab's
        skipping them (slot -1: absent), joined and summed."""
        i, rt = layer.index, self.rt
        if not torch.compiler.is_compiling():  # a compiled token follows an eager one
            self._set_up_handoff(i, x, ids, weights)
        store, key, y_cpu = rt.store, self.store_key, self.cpu_y[i]
        store_ops.cpu_experts(store, key, y_cpu, i, x, ids, weights, self.cpu_rows[i])
        y = rt.computes[i].slab(
            x, self.slabs[i], ids, weights, self.slot_table[i], i in self.checked,
            layer.biases(ids), skip_absent=True,
        )  # fmt: skip
        store_ops.cpu_join(store, key, y_cpu, i)
        return y + y_cpu.to(y.dtype)

    def cpu_list_count(self, i: int) -> int:
        """The length of MoE layer i's CPU list: a host read (the reading path of kinds
        without CPU kernels, CPU backend only: a memory read, no device to wait for)."""
        return int(self.cpu_count[i])

    def _set_up_handoff(
        self, i: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """Set layer i's hand-off up for these dtypes (first call per layer, eager: a
        capture replays the calls of an eager token)."""
        args = (x.dtype, weights.dtype, ids.dtype, cpu_kernels.kernel_threads())
        if self._handoff_set.get(i) == args:
            return
        rt, lays = self.rt, self._host_layouts
        lay = None if lays is None else lays[i]
        if lay is None:
            raise RuntimeError(f"MoE layer {i}: no CPU kernel layout for the hand-off")
        if not self.cpu_y:
            H, dev = rt.spec.hidden_size, rt.store.device
            self.cpu_y = [torch.zeros(1, H, dtype=torch.float32, device=dev) for _ in rt.layers]
        rt.store.cpu_experts_setup(  # SwiGLU: host_layout serves that kind only
            i, lay, x_dtype=x.dtype, w_dtype=weights.dtype, id_dtype=ids.dtype,
            top_k=ids.shape[1], threads=args[3],
        )  # fmt: skip
        self._handoff_set[i] = args

    # --- hand-over between the host and the device caches ----------------------------
    def begin(self) -> None:
        """Take over the sequence's caches from the host ones (after prefill, or after
        host-driven steps): their slots' copies acquired first, so every copy the store
        issued has landed (retried, or raised as CopyError) before gathers reuse slots."""
        rt = self.rt
        store, C = rt.store, rt.capacity
        for L in rt.layers:
            order = L.cache.order()
            slots = L.slots.slots(order)
            if order:
                store.acquire(L.index, slots, order)
                store.release(L.index, slots)
            rest = store.slot_experts(L.index)[C:]
            cs.reset_layer(
                self.state,
                self.layout,
                L.index,
                C,
                order,
                dict(L.slots.slot_of),
                list(L.slots.slot_expert) + rest,
                L.cache.pending(),
                rt.max_inserts(L),
            )
        self.pending.clear()
        self.live = True

    def _read_back(self) -> torch.Tensor:
        """The state on the host, after every gather finished (a sync: sequence ends and
        mode switches only)."""
        self.rt.store.synchronize()
        return self.state.cpu()

    def pull(self) -> None:
        """Hand the caches back to the host ones (a later forward of this sequence takes
        the host-driven step)."""
        if not self.live:
            return
        rt, rows = self.rt, self._read_back()
        self.drain(rows)
        for L in rt.layers:
            order, pending, slot_of, slot_expert = cs.read_layer(rows[L.index], self.layout)
            L.cache.reset(order, pending)
            L.slots.slot_expert = slot_expert[: rt.capacity]
            L.slots.slot_of = slot_of
            rt.store.adopt_slots(L.index, slot_expert)
        self.live = False

    def reset(self) -> None:
        """The sequence ends: the store learns what the slots hold; no route is pending."""
        self.retire()
        self.pending.clear()

    def retire(self) -> None:
        """The sequence ends: the store learns what its slots hold now."""
        if not self.live:
            return
        rows = self._read_back()
        self.drain(rows)
        for L in self.rt.layers:
            _, _, _, slot_expert = cs.read_layer(rows[L.index], self.layout)
            self.rt.store.adopt_slots(L.index, slot_expert)
        self.live = False

    # --- counts and the non-finite flag ----------------------------------------------
    def snapshot(self) -> None:
        """A decode token begins: its layers' counters copied into the snapshot buffer (a
        device copy, no read)."""
        if self._n_snaps + 1 >= MAX_SNAPSHOT_ROWS:
            self.drain()
        n = self._n_snaps
        if n + 1 >= self._snaps.shape[0]:  # keep a row for the read
            grown = torch.zeros(
                2 * self._snaps.shape[0],
                *self._snaps.shape[1:],
                dtype=self._snaps.dtype,
                device=self._snaps.device,
            )
            grown[:n].copy_(self._snaps[:n])
            self._snaps = grown
        self._snaps[n].copy_(self.state[:, self._cols])
        self._n_snaps = n + 1

    def token_time(self, seconds: float) -> None:
        """The host-measured time of the token snapshotted last (CPU: the forward is
        synchronous)."""
        if len(self._times) < self._n_snaps:
            self._times += [0.0] * (self._n_snaps - 1 - len(self._times)) + [seconds]

    def _records(self, snaps: torch.Tensor) -> None:
        """Per-token records from `snaps` (n + 1 rows: n tokens' snapshots, then now)."""
        names = cs.COUNT_NAMES
        diff = snaps[1:, :, : len(names)] - snaps[:-1, :, : len(names)]  # [tokens, layers, .]
        per = diff.sum(1).tolist()
        times = self._times + [0.0] * (len(per) - len(self._times))
        nbytes = self._copy_bytes(diff).tolist()
        stats = self.rt.acct.stats
        for row, t, b in zip(per, times, nbytes, strict=True):
            rec = dict(zip(names, row, strict=True))
            copies = rec["misses"] - rec["cpu_experts"] + rec["prefetches"]
            stats.add_record(rec | {"copies": copies, "bytes_copied": b}, t)
        self._n_snaps, self._times = 0, []

    def _copy_bytes(self, counts: torch.Tensor) -> torch.Tensor:
        """Bytes copied by per-layer counts `[..., layers, COUNT_NAMES]`: each layer's misses
        and prefetches at its own row size (rows differ per layer in a mixed GGUF file)."""
        names = cs.COUNT_NAMES
        at = names.index
        copies = counts[..., at("misses")] - counts[..., at("cpu_experts")]
        copies = copies + counts[..., at("prefetches")]
        return (copies.to(torch.int64) * self._row_bytes).sum(-1)

    def drain(self, rows: torch.Tensor | None = None) -> None:
        """Add the counts accumulated since the last read to the stats, and each
        snapshotted token's record (one device read), and collect the layers whose router
        inputs were not finite."""
        n = self._n_snaps
        if rows is None:
            self._snaps[n].copy_(self.state[:, self._cols])
            snaps = self._snaps[: n + 1].cpu()  # the one read: snapshots and counts
            rows = snaps[n]
        else:  # the whole state, read after a sync: the snapshots are one more read
            rows = rows[:, self._cols]
            snaps = torch.cat([self._snaps[:n].cpu(), rows[None]])
        if n:
            self._records(snaps)
        counts = rows[:, : len(cs.COUNT_NAMES)].to(torch.int64)
        seen, self._seen = self._seen, counts
        delta = (counts - seen).sum(0).tolist()
        acct = self.rt.acct
        got = dict(zip(cs.COUNT_NAMES, delta, strict=True))
        acct.count(**got)
        acct.count(
            copies=got["misses"] - got["cpu_experts"] + got["prefetches"],
            bytes_copied=int(self._copy_bytes(counts - seen)),
        )
        acct.add_stall()
        flags = rows[:, -1]
        if bool(flags.any()):
            self.bad_layers += [i for i in range(len(flags)) if flags[i]]
            self.state[:, self.layout.header + cs.FLAG] = 0

    def check(self) -> None:
        """Raise, once, for router inputs that were not finite since the last check, and
        for a CPU expert task that failed (StoreError)."""
        if self._handoff_set:
            self.rt.store.cpu_check()
        if self.bad_layers:
            bad, self.bad_layers = sorted(set(self.bad_layers)), []
            raise non_finite(bad, "found after decoding")
