"""Fusion groups of a unit's ops over its fx graph: what a torch.compile'd unit runs as one
kernel, and the bytes that kernel moves (`cost_model.parts.fusion` prices them).

Expects a unit's compute nodes in graph order, its ops (`OpProfile`, named after their nodes)
and the measured output specs of the graph's nodes. Guarantees, for each fusible op
(`cost_model.parts.fusion.is_fusible`), its group index among the unit's ops and its fused
bytes per sample; other ops keep ``fusion_group`` -1 and no fused bytes. Within a group:

- members are joined through producer-consumer edges (a view between them is transparent: it
  moves no bytes and inductor indexes through it);
- no member depends on another through an op outside the group (a GEMM, attention, an unfused
  op): such a pair would need the outside op's result inside the kernel, which inductor's
  scheduler never fuses (it would make a cycle between kernels). Joins are made greedily in
  graph order, the first legal group first;
- the group's traffic is each tensor it reads from outside once (parameters and buffers apart:
  the ops' ``param_bytes_read`` count them) plus each member output that a node outside the
  group (or another unit, or the model's output) reads; each byte is charged to the member
  that first reads it or that writes it, so a group's ops sum to its traffic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import fx

from autoplan.tracing.measure import spec_bytes, target_name
from cost_model.parts.fusion import is_fusible
from cost_model.workload import OpProfile

__all__ = ["with_fusion"]


def with_fusion(
    ops: Sequence[OpProfile],
    nodes: Sequence[fx.Node],
    specs: Mapping[fx.Node, Any],
    batch_size: int,
) -> tuple[OpProfile, ...]:
    """``ops`` with their fusion groups and fused bytes per sample (module docstring)."""
    groups = _Groups(nodes, {op.name: op for op in ops}, specs)
    groups.build()
    fused = groups.traffic()
    out = []
    for op in ops:
        found = fused.get(op.name)
        if found is None:
            out.append(op)
            continue
        group, nbytes = found
        out.append(dataclasses.replace(op, fusion_group=group, fused_bytes=nbytes / batch_size))
    return tuple(out)


class _Groups:
    """Union-find over a unit's fusible nodes, with what each group must run after."""

    def __init__(
        self, nodes: Sequence[fx.Node], ops: Mapping[str, OpProfile], specs: Mapping[fx.Node, Any]
    ) -> None:
        self.specs = specs
        self.nodes = list(nodes)
        self.fusible = {
            n for n in self.nodes if n.name in ops and is_fusible(ops[n.name].kind, target_name(n))
        }
        # nodes that do no work (views, getitem, shape reads): transparent
        self.free = {n for n in self.nodes if n.name not in ops}
        self.parent: dict[fx.Node, fx.Node] = {}
        # group root -> groups it must run after (its inputs' producers through other kernels)
        self.after: dict[fx.Node, set[fx.Node]] = {}
        # unfused node -> groups its result depends on
        self.needs: dict[fx.Node, set[fx.Node]] = {}

    def find(self, node: fx.Node) -> fx.Node:
        root = node
        while self.parent[root] is not root:
            root = self.parent[root]
        self.parent[node] = root
        return root

    def _closure(self, roots: Iterable[fx.Node]) -> set[fx.Node]:
        """Every group that must finish before ``roots`` can start, and ``roots``."""
        seen: set[fx.Node] = set()
        stack = [self.find(r) for r in roots]
        while stack:
            root = stack.pop()
            if root in seen:
                continue
            seen.add(root)
            stack.extend(self.find(g) for g in self.after[root])
        return seen

    def nbytes(self, node: fx.Node) -> float:
        """The bytes of ``node``'s output tensors at the traced batch (0: no tensor)."""
        return spec_bytes(self.specs.get(node))

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        """The nodes whose tensors ``node`` reads (not shapes, dtypes or other scalars)."""
        return [arg for arg in node.all_input_nodes if self.nbytes(arg) > 0]

    def source(self, node: fx.Node) -> fx.Node:
        """``node``, or the node a chain of views in the unit reads from (a view's tensor is
        its first argument)."""
        while node in self.free and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return node

    def _depends(self, node: fx.Node) -> set[fx.Node]:
        """The groups (roots) an input ``node`` of a fusible op makes it wait for."""
        if node in self.fusible:
            return {self.find(node)}
        return set(self.needs.get(node, ()))

    def build(self) -> None:
        for node in self.nodes:
            if node in self.fusible:
                self._place(node)
            else:
                needs: set[fx.Node] = set()
                for arg in self.inputs(node):
                    needs |= self._depends(arg)
                self.needs[node] = needs

    def _place(self, node: fx.Node) -> None:
        """Join ``node`` to the groups of its fusible producers where legal, else start one."""
        producers: list[fx.Node] = []
        blocked_by: set[fx.Node] = set()
        for arg in self.inputs(node):
            src = self.source(arg)
            if src in self.fusible:
                root = self.find(src)
                if root not in producers:
                    producers.append(root)
            else:
                blocked_by |= self._depends(src)
        blocked = self._closure(blocked_by)
        chosen: list[fx.Node] = []
        for root in producers:
            if root in blocked:
                continue
            if all(self._apart(root, other) for other in chosen):
                chosen.append(root)
        # a producer left out runs before the group: a chosen group it waits for cannot join
        while True:
            waits = self._closure(blocked_by | {r for r in producers if r not in chosen})
            kept = [root for root in chosen if root not in waits]
            if kept == chosen:
                break
            chosen = kept
        after = {self.find(g) for g in blocked_by}
        after |= {root for root in producers if root not in chosen}
        self.parent[node] = node
        for root in chosen:
            after |= self.after.pop(root)
            self.parent[root] = node
        self.after[node] = {self.find(g) for g in after} - {node}
        assert node not in self._closure(self.after[node]), f"fusion cycle at {node.name}"

    def _apart(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether groups ``a`` and ``b`` may merge: neither waits for the other."""
        return a not in self._closure(self.after[b]) and b not in self._closure(self.after[a])

    def _readers(self, node: fx.Node) -> Iterable[fx.Node]:
        """The nodes that read ``node``'s output, through views in the unit (a shape or dtype
        read reads no data)."""
        for user in node.users:
            if user not in self.free:
                yield user
            elif self.nbytes(user) > 0:
                yield from self._readers(user)

    def traffic(self) -> dict[str, tuple[int, float]]:
        """Op name -> (group index, its share of the group's bytes) at the traced batch."""
        index: dict[fx.Node, int] = {}
        # group root -> (the tensors it has read, the bytes it has read of each source)
        read: dict[fx.Node, tuple[set[fx.Node], dict[fx.Node, float]]] = {}
        out: dict[str, tuple[int, float]] = {}
        for node in self.nodes:
            if node not in self.fusible:
                continue
            root = self.find(node)
            group = index.setdefault(root, len(index))
            seen, charged = read.setdefault(root, (set(), {}))
            nbytes = 0.0
            for arg in self.inputs(node):
                src = self.source(arg)
                if src in self.fusible and self.find(src) is root:
                    continue  # in registers
                if src.op == "get_attr" or arg in seen:
                    continue  # a parameter or buffer (param_bytes_read), or read already
                seen.add(arg)
                # views of one tensor (its halves, read by a rotary embedding) are read once:
                # at most the tensor's own bytes
                whole = max(self.nbytes(src), self.nbytes(arg))
                share = min(self.nbytes(arg), whole - charged.get(src, 0.0))
                charged[src] = charged.get(src, 0.0) + share
                nbytes += share
            if any(
                reader not in self.fusible or self.find(reader) is not root
                for reader in self._readers(node)
            ):
                nbytes += self.nbytes(node)
            out[node.name] = (group, nbytes)
        return out
