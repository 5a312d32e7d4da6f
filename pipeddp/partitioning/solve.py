"""Cut a sequence of layers into balanced contiguous stages.

A pipeline runs at the pace of its slowest stage, so the best cut minimises
the largest stage cost (the *bottleneck*)::

    costs     1  1  1  1  1  1  1  1 10
    greedy   [1  1  1  1  1][1  1  1 10]    bottleneck 13
    optimal  [1  1  1  1  1  1  1  1][10]   bottleneck 10

``solve`` finds the optimal contiguous min-max cut with a dynamic program
(O(n^2 k) for n layers and k stages, instant for any real model). Among the
cuts that reach the optimal bottleneck it picks the one with the smallest sum
of squared stage costs, so the other stages are as even as they can be too.

The time to move an activation to the next device counts: a cut after layer i
makes the link carry ``activation_bytes[i]``, and since the copy runs beside
the compute (its own stream) the segment costs ``max(compute, copy)``.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

__all__ = ["solve", "block_move", "stage_costs", "check_stage_count"]


def check_stage_count(stages: int, layers: int) -> None:
    """The one check (and message) for 'more stages than layers', used wherever a model is cut."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if stages > layers:
        raise ValueError(
            f"cannot cut {layers} layers into {stages} stages: every stage needs at least one layer; use at most "
            f"{layers} stages (devices), or split the model into finer layers, e.g. with "
            "pipeddp.tools.models.flatten_sequential(model, sample)"
        )


def segment_cost(prefix: Sequence[float], comm: Sequence[float], i: int, j: int, last: bool) -> float:
    """Cost of layers i..j-1 as one stage; a non-final stage also sends layer j-1's output."""
    compute = prefix[j] - prefix[i]
    return compute if last else max(compute, comm[j - 1])


def solve(costs: Sequence[float], stages: int, comm: Optional[Sequence[float]] = None) -> List[int]:
    """Optimal contiguous split of ``costs`` into ``stages`` non-empty parts.

    Returns the number of layers per stage. ``comm[i]`` is the cost of sending
    layer i's output to the next stage (default 0). Minimises the bottleneck
    exactly, then the sum of squared stage costs.
    """
    n = len(costs)
    check_stage_count(stages, n)
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be >= 0")
    comm = list(comm) if comm is not None else [0.0] * n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")

    def run(limit: Optional[float]) -> Tuple[List[List[float]], List[List[int]]]:
        # best[k][j]: objective for the first j layers in k stages; objective is the
        # bottleneck (limit None) or the sum of squares under the bottleneck limit.
        best = [[inf] * (n + 1) for _ in range(stages + 1)]
        arg = [[-1] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for k in range(1, stages + 1):
            last = k == stages
            for j in range(k, n - (stages - k) + 1):
                if last and j != n:
                    continue
                for i in range(k - 1, j):
                    if best[k - 1][i] == inf:
                        continue
                    seg = segment_cost(prefix, comm, i, j, last)
                    if limit is None:
                        val = max(best[k - 1][i], seg)
                    else:
                        if seg > limit:
                            continue
                        val = best[k - 1][i] + seg * seg
                    if val < best[k][j]:
                        best[k][j] = val
                        arg[k][j] = i
        return best, arg

    best, _ = run(None)
    bottleneck = best[stages][n]
    tol = 1e-12 * max(1.0, abs(bottleneck))
    _, arg = run(bottleneck + tol)
    cuts = []
    j = n
    for k in range(stages, 0, -1):
        i = arg[k][j]
        cuts.append(j - i)
        j = i
    return cuts[::-1]


def stage_costs(balance: Sequence[int], costs: Sequence[float], comm: Sequence[float]) -> List[float]:
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    out, start = [], 0
    for s, b in enumerate(balance):
        out.append(segment_cost(prefix, comm, start, start + b, s == len(balance) - 1))
        start += b
    return out


def block_move(costs: Sequence[float], stages: int) -> List[int]:
    """The block-move heuristic (Bárány and Grinberg, "Block partitions of sequences").

    Kept as a baseline for comparisons (it is what torchgpipe balances with), not
    used by pipeddp: starting from equal layer counts, it moves one element at a
    time from the block beside the lightest block towards it, and stops once the
    heaviest block exceeds the lightest by at most one largest element (costs
    normalised to [0, 1]). That stop rule is where it goes wrong: on
    ``[1]*8 + [10]`` into 2 it stops at ``[4, 5]`` (bottleneck 14, optimum 10).
    """
    n = len(costs)
    check_stage_count(stages, n)
    lo, hi = min(costs), max(costs)
    norm = [0.0] * n if hi == lo else [(c - lo) / (hi - lo) for c in costs]
    ends = [n // stages * (i + 1) for i in range(stages - 1)] + [n]

    def size(i: int) -> float:
        return sum(norm[(ends[i - 1] if i else 0):ends[i]])

    while True:
        heavy = max(range(stages), key=lambda i: (size(i), i))
        while True:
            light_size = min(size(i) for i in range(stages))
            if size(heavy) <= light_size + 1:
                return [e - s for s, e in zip([0] + ends[:-1], ends)]
            light = min((i for i in range(stages) if size(i) == light_size), key=lambda i: abs(i - heavy))
            donor = light - 1 if heavy < light else light + 1
            if heavy < light:
                ends[donor] -= 1
            else:
                ends[light] += 1
            if donor == heavy:
                break
