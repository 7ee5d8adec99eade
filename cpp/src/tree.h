// Token trees: many candidate continuations verified in one target call (docs/design.md, "Tree
// calls"); the same rules as specedge/runtime/tree.py, drafters/base.py's chain_tree and
// tree_size.py, so the C++ runtime makes the same trees and commits the same tokens.
//
// A Tree is the call's T new tokens in topological order: node 0 is the pending token (the last
// committed one, not yet in the cache), every other node a drafted token whose parent comes before
// it. The target runs them at slots position..position+T-1 with ancestor_mask() and returns one
// row per node: the next-token distribution after that node's root path.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "policy.h"
#include "sampling.h"

namespace specedge {

struct Tree {
  std::vector<int32_t> tokens;
  std::vector<int> parents;  // parents[0] == -1; parents[i] < i
  // Optional draft distributions, one row of `vocab` per node (row 0 unused); an empty row is a
  // point mass at the node's token (any deterministic choice). Empty: every node a point mass.
  std::vector<std::vector<double>> q;

  Tree() = default;
  // Checked like tree.py's Tree (SPECEDGE_ERR_INVALID_ARGUMENT on a malformed tree).
  Tree(std::vector<int32_t> tokens, std::vector<int> parents);
  // The prefix tree of several continuations of `root` (shared prefixes merged, first-seen order).
  static Tree from_paths(int32_t root, const std::vector<std::vector<int32_t>>& paths);
  Tree prefix(int nodes) const;  // the first max(1, nodes) nodes
  int size() const { return int(tokens.size()); }
  const std::vector<int>& children(int node) const { return children_[size_t(node)]; }
  std::vector<int> depths() const;
  int depth() const;  // the deepest node's depth (draft steps on the longest path)
  // uint8 [T, T] row-major: row i marks i and its ancestors (the graph's tree_mask, one batch row).
  std::vector<uint8_t> ancestor_mask() const;

 private:
  std::vector<std::vector<int>> children_;
};

// (accepted path of node ids from the root, tokens to emit): the longest root path whose every
// token is the target's argmax after its parent, then the target's token there (first matching
// child on duplicates). best: one argmax per node.
std::pair<std::vector<int>, std::vector<int32_t>> verify_tree_greedy(const Tree& tree,
                                                                     const std::vector<int32_t>& best);
// Drafts the tree's first line (each node's first child) alone would have had accepted, greedily.
int chain_accepted(const Tree& tree, const std::vector<int32_t>& best, int limit = -1);
// The recursive rejection over one node's children against p (size V): a[i] the probability of
// accepting child i once every child before it was rejected (stops after an a >= 1), and the
// residual to emit from when all are rejected. qs[i]: the child's q row, or nullptr (point mass).
void sibling_rule(const double* p, int V, const std::vector<int32_t>& tokens, const std::vector<const double*>& qs,
                  std::vector<double>& accept, std::vector<double>& residual);
// Exact tree sampling: p_rows [T, V] (probs_from_logits of each node's row). One uniform per child
// tested and one per emitted sample, as tree.py.
std::pair<std::vector<int>, std::vector<int32_t>> verify_tree_sampling(const Tree& tree,
                                                                       const std::vector<double>& p_rows, int V,
                                                                       Rng& rng);
// (source, destination) offsets that put the accepted path in slots 0..len-1: only nodes out of
// place, in increasing order (copying one slot at a time in this order never overwrites a later source).
std::vector<std::pair<int, int>> compaction_moves(const std::vector<int>& path);

// Ids of the n largest entries of p (size V), ties at the cut to the lower ids, increasing id
// order (drafters/base.py top_ids).
std::vector<int> top_ids(const std::vector<double>& p, int n);
// numpy's pairwise float64 sum (np.sum of a contiguous row), so the tree ranking's probabilities
// are the Python runtime's to the last bit.
double pairwise_sum(const double* a, size_t n);
// The draft's chain of k drafts plus ranked runner-up leaf siblings (drafters/base.py chain_tree):
// first_row: the draft's logits [V] after `root`; step(token) feeds a chain token and returns the
// next row [V] (called k - 1 times); at most `nodes` nodes. ids: maps a row index to a target id
// (a head's draft vocabulary, d2t, V entries; the tie rule then compares mapped ids, as Python's);
// nullptr: the same. Greedy (params null or greedy): the argmax line, every node a point mass.
// Sampling: the chain sampled from probs_from_logits(row, params) with one rng uniform per token,
// as propose draws it, each chain node carrying its q row over the target's `vocab` ids; the
// siblings, q's likeliest other tokens, stay point masses.
Tree chain_tree(int32_t root, const float* first_row, int V, const std::function<const float*(int32_t)>& step, int k,
                int nodes, const int32_t* ids = nullptr, const SamplingParams* params = nullptr, Rng* rng = nullptr,
                int vocab = 0);
// tree.py first_line_kept: the first-line nodes (each node's first child) a sampled verification
// kept before leaving the line, at most `limit` (< 0: no limit): what the chain would have kept.
int first_line_kept(const Tree& tree, const std::vector<int>& path, int limit = -1);

// tree_size.py: the extra cost a tree call may have over the chain call of k + 1 tokens, the most
// nodes (the host buffers' reserved call size), and how far past the largest measured size it grows.
constexpr double kTreeSlack = 0.25;
constexpr int kTreeGrowth = 2;
int max_tree_nodes();
// Nodes (root included) of the largest tree whose call costs at most (1 + slack) c(k + 1); >= k + 1.
int tree_nodes(const CostModel& costs, int k, double slack = kTreeSlack, int limit = -1);

// Why a tree request cannot run on a target backend that takes no tree calls: a bundle exported
// without --tree, or (graph_takes_trees) a backend that runs none on a graph that does.
std::string tree_refusal(bool graph_takes_trees, const std::string& backend);
// generator.py inexact_tree_refusal: a target whose single-token steps are padded (kernels whose
// sums depend on the call's shape) would not verify trees exactly.
std::string inexact_tree_refusal(const std::string& precision);

}  // namespace specedge
