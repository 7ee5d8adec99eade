"""One speculative round with a token tree (issue 15; docs/design.md, "Tree calls").

Like `rounds.speculative_round`, but the drafter proposes a `Tree` (several continuations) that
the target scores in ONE call with its ancestor mask; the verifier keeps one root path plus the
target's token (runtime/tree.py), and the target's cache keeps that path's K/V in contiguous
slots (`CacheTracker.keep_path`), so the next call sees an ordinary cache. A drafter that makes
no tree gets the chain round; an empty proposal, a target step.
"""

from __future__ import annotations

from .drafters.base import Drafter
from .rounds import Round, TargetView, clock, speculative_round, target_step
from .sampling import SamplingParams, probs_from_logits
from .tree import chain_accepted, first_line_kept, verify_tree_greedy, verify_tree_sampling

__all__ = ["tree_round"]


def tree_round(
    target: TargetView,
    drafter: Drafter,
    tokens: list[int],
    k: int,
    nodes: int,
    params: SamplingParams,
    rng,
    depth: int | None = None,
) -> Round:
    """Draft a tree of at most `nodes` nodes after `tokens` in place of a chain of k, at most
    `depth` deep (>= k, default k; the drafter may stay shallower), verify it in one target call,
    commit the accepted path. `Round.drafted` counts the tree's drafted nodes; its chain_accepted
    what the chain of k would have kept (greedy: from the target's argmax; sampling: the first-line
    nodes the verification kept), so the guard judges trees against chains in both modes."""
    t0 = clock()
    tree = drafter.propose_tree(tokens, k, nodes, params, rng, depth=max(k, depth or k))
    t1 = clock()
    if tree is None:
        return speculative_round(target, drafter, tokens, k, params, rng)
    if len(tree) < 2:
        plain = target_step(target, tokens, params, rng)
        return Round(plain.tokens, 0, t1 - t0, plain.verify_s, k)
    if tree.tokens[0] != tokens[-1]:
        raise ValueError(f"the tree's root {tree.tokens[0]} is not the pending token {tokens[-1]}")
    cache = target.cache
    position = cache.position  # == len(tokens) - 1: the pending token (the root) is not in the cache
    logits = cache.feed_tree(tree.tokens, tree.ancestor_mask())[:, : target.vocab]
    if params.greedy:
        best = logits.argmax(axis=-1).tolist()
        path, new = verify_tree_greedy(tree, best)
        chain = chain_accepted(tree, best, k)
    else:
        path, new = verify_tree_sampling(tree, probs_from_logits(logits, params), rng)
        chain = first_line_kept(tree, path, k)
    cache.keep_path(position, path)  # the root + the accepted nodes, == position + len(new)
    return Round(
        new, len(tree) - 1, t1 - t0, clock() - t1, k, call=len(tree), depth=max(tree.depths()), chain_accepted=chain
    )
