"""The mask plan: which rank owns which unit, its validation, mixing graph and serialisation."""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from subnetdp.core.contracts import GROUP_BY, Partition
from subnetdp.core.errors import ConfigError, PlanError


@dataclass
class MaskPlan:
    """For each rank, the sorted ids of the units it owns.

    Attributes:
        world_size: number of ranks the plan is made for.
        owned: ``owned[r]`` = sorted unit ids of rank ``r``.
        num_units: K, the number of units in the partition.
        nodes: how many nodes the ranks span (rank ``r`` on node ``r // (world_size // nodes)``, unless
            ``node_of`` says otherwise).
        node_of: the node of each rank when the ranks do not split into equal nodes in that order:
            after a death the survivors stay on their nodes (numbered as the job numbered them), so
            ``nodes`` is then the number of nodes that hold a rank. Empty: the even split.

    Neither ``nodes`` nor ``node_of`` is part of the digest: the same owners on another node layout
    are the same plan.
    """

    world_size: int
    owned: list[list[int]]
    num_units: int
    nodes: int = 1
    node_of: tuple[int, ...] = ()
    _owners: list[tuple[int, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.owned = [sorted(int(u) for u in units) for units in self.owned]
        if len(self.owned) != self.world_size:
            raise PlanError(f"plan lists {len(self.owned)} ranks for world size {self.world_size}")
        owners: list[list[int]] = [[] for _ in range(self.num_units)]
        for r, units in enumerate(self.owned):
            for u in units:
                if not 0 <= u < self.num_units:
                    raise PlanError(f"rank {r} owns unit {u}, but the partition has units 0..{self.num_units - 1}")
                owners[u].append(r)
        self._owners = [tuple(o) for o in owners]
        self.node_of = tuple(int(n) for n in self.node_of)
        if self.node_of and (len(self.node_of) != self.world_size or len(set(self.node_of)) != self.nodes):
            raise PlanError(f"node_of {list(self.node_of)} does not place {self.world_size} ranks on {self.nodes} node(s)")

    # ---------------------------------------------------------------- queries
    def owners(self, unit: int) -> tuple[int, ...]:
        """Sorted ranks that own ``unit``."""
        return self._owners[unit]

    def k(self, unit: int) -> int:
        return len(self._owners[unit])

    def owner_sets(self) -> list[tuple[int, ...]]:
        """Distinct owner sets of the units, sorted; the world set (shared tensors) last."""
        world = tuple(range(self.world_size))
        sets = sorted({o for o in self._owners if o and o != world})
        return sets + [world]

    def replicated(self, shard_size: int) -> "MaskPlan":
        """The plan over ``world_size * shard_size`` ranks in which rank ``r * S + s`` owns ``owned[r]``.

        With FSDP (``fsdp.shard_size = S``) plans are made over the R replicas; the S ranks of a
        replica hold the same subnetwork in shards. The replicated plan is what checkpoints, the
        union model and the run directory see.
        """
        if shard_size == 1:
            return self
        ranks = range(self.world_size * shard_size)
        return MaskPlan(self.world_size * shard_size, [self.owned[r // shard_size] for r in ranks], self.num_units,
                        self.nodes, tuple(self.node_of[r // shard_size] for r in ranks) if self.node_of else ())

    def replicas(self, shard_size: int) -> "MaskPlan":
        """Inverse of :meth:`replicated`: the plan over the replicas (rank ``r * S`` of each)."""
        return MaskPlan(self.world_size // shard_size, self.owned[::shard_size], self.num_units, self.nodes,
                        self.node_of[::shard_size])

    def without(self, members: Sequence[int], min_owners: int = 1) -> "MaskPlan":
        """The plan over the surviving ``members`` (old ranks, ascending; ``members[i]`` becomes rank i).

        The in-process re-plan rule (docs/inprocess.md): every unit keeps its surviving owners, and
        a unit left below ``min_owners`` gains the survivors with the fewest units (ties: the lowest
        rank), so at most the lost ranks' share of the model moves. Raises :class:`PlanError` when a
        unit has no surviving owner: nobody holds its values, the survivors' files must assemble it.

        The survivors stay on their nodes: a plan over several nodes keeps each survivor's node
        (``node_of``), and ``nodes`` counts the nodes that still hold one (1 after all but one were lost).
        """
        alive = sorted(int(r) for r in members)
        new_rank = {old: i for i, old in enumerate(alive)}
        orphans = [u for u in range(self.num_units) if not any(r in new_rank for r in self._owners[u])]
        if orphans:
            raise PlanError(f"unit(s) {orphans[:8]} have no owner among the surviving ranks {alive}")
        owned = [[u for u in self.owned[old]] for old in alive]
        for u in range(self.num_units):
            holders = {new_rank[r] for r in self._owners[u] if r in new_rank}
            while len(holders) < min(min_owners, len(alive)):
                gain = min((r for r in range(len(alive)) if r not in holders), key=lambda r: (len(owned[r]), r))
                owned[gain].append(u)
                holders.add(gain)
        if self.nodes == 1 and not self.node_of:  # a one-node plan stays one
            return MaskPlan(len(alive), owned, self.num_units)
        placed = self.rank_nodes()
        node_of = tuple(placed[old] for old in alive)
        return MaskPlan(len(alive), owned, self.num_units, len(set(node_of)), node_of)

    def rank_nodes(self) -> tuple[int, ...]:
        """The node of each rank: ``node_of``, or the even split over ``nodes`` (torchrun's numbering)."""
        if self.node_of:
            return self.node_of
        per_node = max(1, self.world_size // self.nodes)
        return tuple(r // per_node for r in range(self.world_size))

    def owner_counts(self) -> list[int]:
        return [len(o) for o in self._owners]

    def failures_survived(self) -> int:
        """How many ranks may die at once, whichever they are, with every unit still held by a survivor.

        ``min_u k(u) - 1``: the unit with the fewest owners is lost once all of them die. Shared
        tensors are held by every rank, so only the units count. (A dead rank's data position and RNG
        are recomputed from the step, so they never limit this.)
        """
        counts = self.owner_counts()
        return (min(counts) if counts else self.world_size) - 1

    def node_failures_survived(self, nodes: int | None = None) -> int:
        """How many whole nodes may die at once, with ``nodes`` nodes of ``world_size // nodes`` ranks
        each (rank ``r`` on node ``r // per_node``, as torchrun numbers them); None: the plan's own
        placement (:meth:`rank_nodes`: after a death, the survivors' nodes).

        A node is the usual unit of failure on a cluster: a unit whose owners share one node is lost
        with it, however many owners it has. ``min_u (distinct nodes of u's owners) - 1``.
        """
        if nodes is None:
            placed, nodes = self.rank_nodes(), self.nodes
        elif nodes < 1 or self.world_size % nodes:
            raise PlanError(f"--nodes={nodes}: the world of {self.world_size} ranks does not split into "
                            f"{nodes} equal nodes; give a divisor of {self.world_size}")
        else:
            placed = tuple(r // (self.world_size // nodes) for r in range(self.world_size))
        spans = [len({placed[r] for r in owners}) for owners in self._owners]
        return (min(spans) if spans else nodes) - 1

    # ---------------------------------------------------------------- validation
    def validate(self, min_owners: int = 1, names: Sequence[str] | None = None,
                 hint: Callable[[], str] | None = None) -> None:
        """Raise :class:`PlanError` naming every unit with fewer than ``min_owners`` owners."""
        bad = [u for u in range(self.num_units) if self.k(u) < min_owners]
        if not bad:
            return
        label = [names[u] if names else str(u) for u in bad]
        shown = ", ".join(label[:8]) + (f", ... ({len(label)} in all)" if len(label) > 8 else "")
        msg = (f"the mask plan leaves {len(bad)} unit(s) with fewer than masker.min_owners={min_owners} "
               f"owner(s): {shown}")
        if hint is not None:
            msg += f"; {hint()}"
        raise PlanError(msg)

    # ---------------------------------------------------------------- mixing graph
    def mixing_matrix(self, partition: Partition) -> np.ndarray:
        """``sum_u |u| A_u / sum_u |u|``; ``A_u`` averages the owners of u and leaves others alone.

        Shared tensors count as one unit owned by every rank.
        """
        W = self.world_size
        total = np.zeros((W, W))
        weight = 0.0
        items = [(partition.unit_numel(u), self.owners(u.id)) for u in partition.units]
        items.append((partition.shared_numel(), tuple(range(W))))
        for size, owners in items:
            if size == 0 or not owners:
                continue
            A = np.eye(W)
            idx = np.array(owners)
            A[np.ix_(idx, idx)] = 1.0 / len(owners)
            total += size * A
            weight += size
        return total / max(weight, 1.0)

    def spectral_gap(self, partition: Partition) -> float:
        """``1 - lambda_2`` of the mixing matrix (reported, not enforced).

        Up to :data:`DENSE_GAP_RANKS` ranks from the dense matrix; above, by Lanczos iteration
        (``scipy.sparse.linalg.eigsh``) on the matrix applied owner set by owner set with the
        all-ones eigenvector (eigenvalue 1) projected out, which needs no W x W matrix (a dense
        eigendecomposition of 4,096 ranks takes minutes).
        """
        if self.world_size == 1:
            return 1.0
        if self.world_size <= DENSE_GAP_RANKS:
            eig = np.sort(np.linalg.eigvalsh(self.mixing_matrix(partition)))[::-1]
            return float(1.0 - eig[1])
        from scipy.sparse.linalg import LinearOperator, eigsh

        W = self.world_size
        weights: dict[tuple[int, ...], float] = {}
        for u in partition.units:
            if self.owners(u.id):
                weights[self.owners(u.id)] = weights.get(self.owners(u.id), 0.0) + partition.unit_numel(u)
        world = tuple(range(W))
        weights[world] = weights.get(world, 0.0) + partition.shared_numel()
        total = sum(weights.values()) or 1.0
        sets = [(np.array(o), w / total) for o, w in weights.items() if w > 0]

        def apply(x: np.ndarray) -> np.ndarray:
            x = np.asarray(x, dtype=np.float64).reshape(-1)
            x = x - x.mean()  # project out the all-ones eigenvector
            y = x * sum(w for _, w in sets)
            for idx, w in sets:
                y[idx] += w * (x[idx].mean() - x[idx])
            return y - y.mean()

        op = LinearOperator((W, W), matvec=apply, dtype=np.float64)
        lam = eigsh(op, k=1, which="LA", tol=1e-10, v0=np.cos(np.arange(W) + 0.5), return_eigenvectors=False)
        return float(1.0 - min(1.0, max(0.0, lam[0])))

    def unit_graph_components(self) -> int:
        """Connected components of the rank graph whose edges join co-owners of a unit."""
        parent = list(range(self.world_size))

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for owners in self._owners:
            for r in owners[1:]:
                parent[find(r)] = find(owners[0])
        return len({find(r) for r in range(self.world_size)})

    # ---------------------------------------------------------------- coverage
    def effective_coverage(self, partition: Partition, group_by: str = "auto") -> dict[str, list[float]]:
        """Per group, each rank's kept fraction ``n_g / K_g``."""
        out: dict[str, list[float]] = {}
        for g, members in group_units(partition, group_by).items():
            ids = set(members)
            out[g] = [len(ids.intersection(self.owned[r])) / len(ids) for r in range(self.world_size)]
        return out

    def warn_coverage(self, partition: Partition, requested: float, group_by: str = "auto",
                      tol: float = 0.05) -> list[str]:
        """Warn (and return the messages) for groups whose coverage is more than ``tol`` off."""
        msgs = []
        groups = group_units(partition, group_by)
        for g, covs in self.effective_coverage(partition, group_by).items():
            eff = max(covs)
            if abs(eff - requested) > tol:
                k = len(groups[g])
                msgs.append(f"group {g}: {round(eff * k)} of {k} units kept (effective coverage {eff:.3f})")
        if msgs:  # one warning for all groups, so it is printed once
            warnings.warn(f"masker.coverage={requested} is not met exactly: " + "; ".join(msgs)
                          + " (set masker.group_by=model to draw across all groups)", stacklevel=2)
        return msgs

    # ---------------------------------------------------------------- serialisation
    def to_dict(self, partition: Partition | None = None, group_by: str = "auto") -> dict:
        d: dict = {"world_size": self.world_size, "num_units": self.num_units, "owned": self.owned}
        if partition is not None:
            d["units"] = [{"id": u.id, "name": u.name, "group": u.group, "cost": u.cost,
                           "numel": partition.unit_numel(u), "owners": list(self.owners(u.id))}
                          for u in partition.units]
            d["shared_numel"] = partition.shared_numel()
            d["effective_coverage"] = self.effective_coverage(partition, group_by)
            d["spectral_gap"] = self.spectral_gap(partition)
            d["components"] = self.unit_graph_components()
            d["params_per_rank"] = self.params_per_rank(partition)
            d["cost_per_rank"] = self.cost_per_rank(partition)
        if self.nodes > 1 or self.node_of:  # a one-node plan.json stays as it was (not a job that lost nodes)
            d["nodes"] = self.nodes
            d["node_failures_survived"] = self.node_failures_survived()
            if self.node_of:  # the survivors of a death, on the nodes they started on
                d["node_of_rank"] = list(self.node_of)
        d["digest"] = self.digest()
        return d

    def to_json(self, partition: Partition | None = None) -> str:
        return json.dumps(self.to_dict(partition), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "MaskPlan":
        plan = cls(int(d["world_size"]), [list(x) for x in d["owned"]], int(d["num_units"]), int(d.get("nodes", 1)),
                   tuple(d.get("node_of_rank", ())))
        if "digest" in d and d["digest"] != plan.digest():
            raise PlanError("plan.json is corrupt: its digest does not match its contents")
        return plan

    def digest(self) -> str:
        """A hash that ranks compare to prove they hold the same plan."""
        payload = json.dumps({"w": self.world_size, "k": self.num_units, "owned": self.owned},
                             sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def params_per_rank(self, partition: Partition) -> list[int]:
        shared = partition.shared_numel()
        sizes = [partition.unit_numel(u) for u in partition.units]
        return [shared + sum(sizes[u] for u in self.owned[r]) for r in range(self.world_size)]

    def cost_per_rank(self, partition: Partition) -> list[float]:
        """Each rank's forward FLOPs per sample over the units it owns (the adapter's unit costs)."""
        return [float(sum(partition.units[u].cost for u in self.owned[r])) for r in range(self.world_size)]

    def as_image(self) -> np.ndarray:
        """Ranks x units ownership matrix (1 = owned) as float32, for TensorBoard."""
        img = np.zeros((self.world_size, self.num_units), dtype=np.float32)
        for r, units in enumerate(self.owned):
            img[r, units] = 1.0
        return img


def units_kept(coverage: float, k: int) -> int:
    """``n_g = max(1, floor(C * K_g + 0.5))``: nearest, halves up."""
    return max(1, min(k, math.floor(coverage * k + 0.5)))


DENSE_GAP_RANKS = 256  # above, the spectral gap comes from Lanczos iteration, not the dense matrix


def group_units(partition: Partition, group_by: str = "auto") -> dict[str, list[int]]:
    """Unit ids by the groups a masker draws from in equal measure (group name -> ids).

    ``auto`` keeps the adapter's groups (a ResNet stage, a LLaMA model); ``model`` puts every unit
    into one group (for models whose groups are too small to express the coverage).
    """
    if group_by == "model":
        return {"model": [u.id for u in partition.units]}
    return {g: [u.id for u in units] for g, units in partition.groups().items()}


def rank_coverages(mcfg: Any, world_size: int) -> list[float]:
    """Each rank's coverage: ``masker.capacity`` (one per rank) or ``masker.coverage`` for all."""
    from subnetdp.core.errors import ConfigError

    capacity = [float(c) for c in mcfg.capacity]
    if not capacity:
        return [mcfg.coverage] * world_size
    if len(capacity) != world_size:
        raise ConfigError("masker.capacity", capacity, f"has {len(capacity)} entries for {world_size} ranks "
                          "(replicas, with fsdp.shard_size > 1)", "give one coverage per rank, or [] for masker.coverage")
    return capacity


def _is_valid(plan: MaskPlan, min_owners: int) -> bool:
    return all(plan.k(u) >= min_owners for u in range(plan.num_units))


def smallest_coverage(masker: "Any", partition: Partition, world_size: int, seed: int, min_owners: int,
                      above: float = 0.0) -> float | None:
    """The smallest ``masker.coverage`` above ``above`` whose plan gives every unit ``min_owners`` owners
    at ``world_size`` ranks (None if none does). Candidates are the coverages the masker can tell apart:
    ``n / K_g`` for every group of ``K_g`` units."""
    import copy

    groups = group_units(partition, masker.cfg.group_by)
    candidates = sorted({n / len(g) for g in groups.values() for n in range(1, len(g) + 1) if n / len(g) > above})
    for c in candidates:
        cfg = copy.deepcopy(masker.cfg)
        cfg.coverage = c
        if _is_valid(type(masker)(cfg).plan(partition, world_size, seed), min_owners):
            return c
    return None


def _coverage_hint(masker: "Any", partition: Partition, world_size: int, seed: int, min_owners: int) -> str:
    """The smallest coverage, and the smallest world size, for which the masker covers every unit."""
    requested = masker.cfg.coverage
    hints = []
    c = smallest_coverage(masker, partition, world_size, seed, min_owners, above=requested)
    if c is not None:
        hints.append(f"the smallest masker.coverage that works with {world_size} ranks is {c:.4g}")
    for w in range(world_size + 1, 16 * world_size + 1):
        if _is_valid(masker.plan(partition, w, seed), min_owners):
            hints.append(f"masker.coverage={requested:g} works from {w} ranks on")
            break
    return "; ".join(hints) if hints else "raise masker.coverage or lower masker.min_owners"


def check_nodes(nodes: int, world_size: int, key: str = "masker.nodes") -> int:
    """``nodes`` if the ``world_size`` ranks split into that many equal nodes; else one line naming ``key``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if not 1 <= nodes <= world_size or world_size % nodes:
        raise ConfigError(key, nodes, f"does not split the {world_size} ranks into equal nodes",
                          f"give a divisor of {world_size}: {', '.join(map(str, divisors))}")
    return nodes


def node_order(world_size: int, nodes: int) -> list[int]:
    """The ranks with the nodes interleaved: the first rank of every node, then the second, ...

    Maskers give neighbouring positions overlapping units (cyclic's runs, balanced's least-loaded
    ties, random's fewest-owners draw), so a plan made over this order and then handed to the ranks
    it names puts a unit's co-owners on different nodes. One node: the identity.
    """
    per_node = world_size // nodes
    return [n * per_node + i for i in range(per_node) for n in range(nodes)]


def interleave_nodes(plan: MaskPlan, nodes: int) -> MaskPlan:
    """``plan``'s position ``s`` becomes rank ``node_order[s]``: the same unit sets, on other ranks.

    A relabelling keeps every property a masker promises about the multiset of rank sets (owner
    counts, units and cost per rank, owner sets per group); only which rank holds which set moves.
    """
    order = node_order(plan.world_size, nodes)
    owned: list[list[int]] = [[] for _ in range(plan.world_size)]
    for s, r in enumerate(order):
        owned[r] = plan.owned[s]
    return MaskPlan(plan.world_size, owned, plan.num_units, nodes)


def make_plan(masker: "Any", partition: Partition, world_size: int, seed: int, min_owners: int = 1,
              nodes: int = 1) -> MaskPlan:
    """Run the masker and validate its plan (before any process group exists).

    ``nodes > 1``: the masker plans over the ranks in :func:`node_order` (nodes interleaved), so a
    unit's owners sit on different nodes where the coverage allows; one node gives the masker's plan.
    """
    rank_coverages(masker.cfg, world_size)  # a capacity list of the wrong length fails here, by name
    check_nodes(nodes, world_size)
    planner = masker
    if nodes > 1 and masker.cfg.capacity:  # position s plans with the capacity of the rank it becomes
        import copy

        cfg = copy.deepcopy(masker.cfg)
        cfg.capacity = [masker.cfg.capacity[r] for r in node_order(world_size, nodes)]
        planner = type(masker)(cfg)
    plan = planner.plan(partition, world_size, seed)
    if plan.world_size != world_size or plan.num_units != len(partition.units):
        raise PlanError(f"masker '{masker.name}' returned a plan for {plan.world_size} ranks and "
                        f"{plan.num_units} units; expected {world_size} ranks and {len(partition.units)} units")
    if nodes > 1:
        plan = interleave_nodes(plan, nodes)
    names = [u.name for u in partition.units]
    plan.validate(min_owners, names, hint=lambda: _coverage_hint(masker, partition, world_size, seed, min_owners))
    if min_owners > world_size:
        raise PlanError(f"masker.min_owners={min_owners} exceeds the world size {world_size}")
    if not masker.cfg.capacity:  # with capacities, ranks differ on purpose
        plan.warn_coverage(partition, masker.cfg.coverage, masker.cfg.group_by)
    return plan
