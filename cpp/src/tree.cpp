#include "tree.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "backend.h"
#include "error.h"

namespace specedge {

// ---------------------------------------------------------------------------- the tree

Tree::Tree(std::vector<int32_t> t, std::vector<int> p) : tokens(std::move(t)), parents(std::move(p)) {
  if (tokens.empty()) fail_arg("a tree needs at least its root");
  if (parents.size() != tokens.size())
    fail_arg("a tree needs one parent per token, got " + std::to_string(parents.size()) + " for " +
             std::to_string(tokens.size()));
  if (parents[0] != -1) fail_arg("node 0 is the root: its parent must be -1");
  children_.assign(tokens.size(), {});
  for (size_t i = 1; i < parents.size(); ++i) {
    if (parents[i] < 0 || size_t(parents[i]) >= i)
      fail_arg("node " + std::to_string(i) + "'s parent " + std::to_string(parents[i]) +
               " must be an earlier node (topological order)");
    children_[size_t(parents[i])].push_back(int(i));
  }
}

Tree Tree::from_paths(int32_t root, const std::vector<std::vector<int32_t>>& paths) {
  std::vector<int32_t> tokens{root};
  std::vector<int> parents{-1};
  std::map<std::pair<int, int32_t>, int> index;
  for (const auto& path : paths) {
    int node = 0;
    for (int32_t t : path) {
      auto key = std::make_pair(node, t);
      auto it = index.find(key);
      if (it == index.end()) {
        it = index.emplace(key, int(tokens.size())).first;
        tokens.push_back(t);
        parents.push_back(node);
      }
      node = it->second;
    }
  }
  return Tree(std::move(tokens), std::move(parents));
}

Tree Tree::prefix(int nodes) const {
  size_t n = std::min(size_t(std::max(1, nodes)), tokens.size());
  Tree t(std::vector<int32_t>(tokens.begin(), tokens.begin() + long(n)),
         std::vector<int>(parents.begin(), parents.begin() + long(n)));
  if (!q.empty()) t.q.assign(q.begin(), q.begin() + long(n));
  return t;
}

std::vector<int> Tree::depths() const {
  std::vector<int> d(tokens.size(), 0);
  for (size_t i = 1; i < parents.size(); ++i) d[i] = d[size_t(parents[i])] + 1;
  return d;
}

int Tree::depth() const {
  auto d = depths();
  return *std::max_element(d.begin(), d.end());
}

std::vector<uint8_t> Tree::ancestor_mask() const {
  size_t T = tokens.size();
  std::vector<uint8_t> m(T * T, 0);
  for (size_t i = 0; i < T; ++i) {
    if (parents[i] >= 0) std::copy_n(m.begin() + long(size_t(parents[i]) * T), T, m.begin() + long(i * T));
    m[i * T + i] = 1;
  }
  return m;
}

// ---------------------------------------------------------------------------- verification

std::pair<std::vector<int>, std::vector<int32_t>> verify_tree_greedy(const Tree& tree,
                                                                     const std::vector<int32_t>& best) {
  if (int(best.size()) != tree.size())
    fail_arg("need one argmax per tree node (" + std::to_string(tree.size()) + "), got " + std::to_string(best.size()));
  std::vector<int> path{0};
  std::vector<int32_t> out;
  int node = 0;
  while (true) {
    int next = -1;
    for (int c : tree.children(node))
      if (tree.tokens[size_t(c)] == best[size_t(node)]) {
        next = c;
        break;
      }
    out.push_back(best[size_t(node)]);
    if (next < 0) return {path, out};
    path.push_back(next);
    node = next;
  }
}

int chain_accepted(const Tree& tree, const std::vector<int32_t>& best, int limit) {
  int n = 0, node = 0;
  while (!tree.children(node).empty() && (limit < 0 || n < limit)) {
    int first = tree.children(node)[0];
    if (tree.tokens[size_t(first)] != best[size_t(node)]) break;
    ++n;
    node = first;
  }
  return n;
}

// numpy's pairwise summation (loops_utils.h: 8 accumulators, blocks of 128, halves otherwise)
double pairwise_sum(const double* a, size_t n) {
  if (n < 8) {
    double res = 0.;
    for (size_t i = 0; i < n; ++i) res += a[i];
    return res;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + size_t(j)];
    double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) res += a[i];
    return res;
  }
  size_t n2 = n / 2;
  n2 -= n2 % 8;
  return pairwise_sum(a, n2) + pairwise_sum(a + n2, n - n2);
}

void sibling_rule(const double* p, int V, const std::vector<int32_t>& tokens, const std::vector<const double*>& qs,
                  std::vector<double>& accept, std::vector<double>& residual) {
  residual.assign(p, p + V);
  accept.clear();
  std::vector<double> next(static_cast<size_t>(V));
  for (size_t i = 0; i < tokens.size(); ++i) {
    size_t x = size_t(tokens[i]);
    const double* q = i < qs.size() ? qs[i] : nullptr;
    double a;
    if (!q || q[x] <= 0) {
      // a point mass at x (also for q(x) == 0, like the chain): accept with r(x); the residual
      // max(0, r - onehot(x)) is r without x
      a = residual[x];
      next = residual;
      next[x] = 0.0;
    } else {
      a = std::min(1.0, residual[x] / q[x]);
      for (size_t v = 0; v < size_t(V); ++v) next[v] = std::max(residual[v] - q[v], 0.0);
    }
    accept.push_back(a);
    if (a >= 1.0) return;  // never rejected: the residual is never used
    double total = pairwise_sum(next.data(), next.size());
    // a rejection implies mass left somewhere; only rounding (r ~= q) leaves none
    if (total > 0)
      for (size_t v = 0; v < size_t(V); ++v) residual[v] = next[v] / total;
  }
}

std::pair<std::vector<int>, std::vector<int32_t>> verify_tree_sampling(const Tree& tree,
                                                                       const std::vector<double>& p_rows, int V,
                                                                       Rng& rng) {
  if (V < 1 || p_rows.size() != size_t(tree.size()) * size_t(V))
    fail_arg("target_probs must be [" + std::to_string(tree.size()) + ", V] (one row per tree node)");
  for (size_t i = 1; i < tree.tokens.size(); ++i)
    if (tree.tokens[i] < 0 || tree.tokens[i] >= V)
      fail_arg("draft token " + std::to_string(tree.tokens[i]) + " is outside the vocabulary [0, " + std::to_string(V) +
               ")");
  std::vector<int> path{0};
  std::vector<int32_t> out;
  std::vector<double> accept, residual;
  int node = 0;
  while (true) {
    const auto& kids = tree.children(node);
    std::vector<int32_t> toks;
    std::vector<const double*> qs;
    for (int c : kids) {
      toks.push_back(tree.tokens[size_t(c)]);
      qs.push_back(tree.q.empty() || tree.q[size_t(c)].empty() ? nullptr : tree.q[size_t(c)].data());
    }
    sibling_rule(p_rows.data() + size_t(node) * size_t(V), V, toks, qs, accept, residual);
    int chosen = -1;
    for (size_t i = 0; i < accept.size(); ++i)
      if (rng.uniform() < accept[i]) {
        chosen = kids[i];
        break;
      }
    if (chosen < 0) {
      out.push_back(sample(residual.data(), V, rng));
      return {path, out};
    }
    out.push_back(tree.tokens[size_t(chosen)]);
    path.push_back(chosen);
    node = chosen;
  }
}

std::vector<std::pair<int, int>> compaction_moves(const std::vector<int>& path) {
  std::vector<std::pair<int, int>> moves;
  for (size_t dst = 0; dst < path.size(); ++dst) {
    int src = path[dst];
    if (dst && src <= path[dst - 1]) fail_arg("an accepted path's node ids must increase");
    if (src != int(dst)) moves.emplace_back(src, int(dst));
  }
  return moves;
}

// ---------------------------------------------------------------------------- drafting

std::vector<int> top_ids(const std::vector<double>& p, int n) {
  int V = int(p.size());
  std::vector<int> ids(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i) ids[size_t(i)] = i;
  if (n >= V) return ids;
  if (n <= 0) return {};
  // the n largest, lower id first among equals; then back to id order
  std::nth_element(ids.begin(), ids.begin() + (n - 1), ids.end(), [&](int a, int b) {
    return p[size_t(a)] > p[size_t(b)] || (p[size_t(a)] == p[size_t(b)] && a < b);
  });
  ids.resize(size_t(n));
  std::sort(ids.begin(), ids.end());
  return ids;
}

Tree chain_tree(int32_t root, const float* first_row, int V, const std::function<const float*(int32_t)>& step, int k,
                int nodes, const int32_t* ids, const SamplingParams* params, Rng* rng, int vocab) {
  const bool sampled = params && !params->greedy();
  if (sampled && (!rng || vocab <= 0)) fail_arg("a sampled chain tree needs the request's rng and the target's vocab");
  int extra = std::max(0, nodes - 1 - k);
  const float* row = first_row;
  std::vector<int32_t> chain;
  std::vector<std::vector<double>> qs;  // sampling: each chain token's q row over the target's ids
  struct Alt {
    double prob;
    int parent;
    int32_t token;
  };
  std::vector<Alt> alts;
  double reach = 1.0;
  std::vector<double> p(static_cast<size_t>(V));
  for (int j = 0; j < k; ++j) {
    int pick;
    if (sampled) {
      // base.py: the chain `propose` would sample, one uniform per token, its q rows kept so the
      // first child is tested with min(1, p/q) as in a chain round
      probs_from_logits(row, V, *params, p);
      pick = sample(p.data(), V, *rng);
      std::vector<double> q(static_cast<size_t>(vocab), 0.0);
      for (int v = 0; v < V; ++v) q[size_t(ids ? ids[v] : v)] = p[size_t(v)];
      qs.push_back(std::move(q));
    } else {
      pick = argmax(row, V);
      if (extra) {
        double zb = double(row[pick]);
        for (int v = 0; v < V; ++v) p[size_t(v)] = std::exp(double(row[v]) - zb);
        double total = pairwise_sum(p.data(), p.size());
        for (double& x : p) x /= total;
      }
    }
    if (extra) {
      for (int t : top_ids(p, extra + 1))
        if (t != pick && p[size_t(t)] > 0) alts.push_back({reach * p[size_t(t)], j, ids ? ids[t] : int32_t(t)});
      reach *= p[size_t(pick)];
    }
    const int32_t tok = ids ? ids[pick] : int32_t(pick);
    chain.push_back(tok);
    if (j < k - 1) row = step(tok);
  }
  std::vector<int32_t> tokens{root};
  std::vector<int> parents{-1};
  for (int j = 0; j < k; ++j) {
    tokens.push_back(chain[size_t(j)]);
    parents.push_back(j);
  }
  std::sort(alts.begin(), alts.end(), [](const Alt& a, const Alt& b) {
    if (a.prob != b.prob) return a.prob > b.prob;
    if (a.parent != b.parent) return a.parent < b.parent;
    return a.token < b.token;
  });
  for (size_t i = 0; i < alts.size() && int(i) < extra; ++i) {
    tokens.push_back(alts[i].token);
    parents.push_back(alts[i].parent);  // chain node `parent` is the depth-`parent` prefix
  }
  Tree tree(std::move(tokens), std::move(parents));
  if (sampled) {
    tree.q.assign(size_t(tree.size()), {});  // siblings: empty rows, point masses
    for (int j = 0; j < k; ++j) tree.q[size_t(j) + 1] = std::move(qs[size_t(j)]);
  }
  return tree.prefix(nodes);
}

int first_line_kept(const Tree& tree, const std::vector<int>& path, int limit) {
  int n = 0;
  for (size_t i = 1; i < path.size(); ++i) {
    const auto& kids = tree.children(path[i - 1]);
    if ((limit >= 0 && n >= limit) || kids.empty() || kids[0] != path[i]) break;
    ++n;
  }
  return n;
}

int max_tree_nodes() { return reserved_call_size(0); }

int tree_nodes(const CostModel& costs, int k, double slack, int limit) {
  if (k < 1) fail_arg("k must be >= 1, got " + std::to_string(k));
  if (slack < 0) fail_arg("slack must be >= 0");
  if (limit < 0) limit = max_tree_nodes();
  double budget = (1.0 + slack) * costs.target_cost(k + 1);
  int largest = k + 1;
  for (const auto& kv : costs.target) largest = std::max(largest, kv.first);
  int ceiling = std::min(limit, largest + kTreeGrowth);
  int n = k + 1;
  while (n < ceiling && costs.target_cost(n + 1) <= budget) ++n;
  return n;
}

std::string tree_refusal(bool graph_takes_trees, const std::string& backend) {
  if (graph_takes_trees)
    return "tree verification is not available on the " + backend +
           " backend, although the bundle's target graph takes trees: use the ort-cpu backend, or leave tree off";
  return "tree verification needs a target graph that takes trees: export the bundle with --tree";
}

// ---------------------------------------------------------------------------- backends

void Backend::check_tree_call(int t, int position, const uint8_t* mask) const {
  if (!takes_trees()) fail_backend("the " + role() + " graph takes no tree calls (export the bundle with --tree)");
  check_call(t, position);
  if (!mask) fail_arg("a tree call needs a mask");
  for (int i = 0; i < t; ++i)
    for (int j = 0; j < t; ++j)
      if ((i == j && !mask[size_t(i) * size_t(t) + size_t(j)]) || (j > i && mask[size_t(i) * size_t(t) + size_t(j)]))
        fail_arg("a tree mask must mark every token itself and only earlier tokens (topological order)");
}

const float* Backend::run_tree(const int32_t* /*ids*/, int t, int position, const uint8_t* mask) {
  check_tree_call(t, position, mask);
  fail_backend("backend '" + name() + "' does not run tree calls yet");
}

void Backend::keep_path(int /*position*/, const std::vector<int>& /*path*/) {
  fail_backend("backend '" + name() + "' does not run tree calls yet");
}

std::string inexact_tree_refusal(const std::string& precision) {
  std::string fix =
      precision == "int4" ? ", or re-export with --int4-kernel specedge (batch-invariant kernels, exact trees)" : "";
  return "tree verification would not be exact on this " + precision +
         " target: ONNX Runtime's attention orders a tree node's sums differently from a chain's, enough to change "
         "its picks; leave tree off" +
         fix;
}

}  // namespace specedge
