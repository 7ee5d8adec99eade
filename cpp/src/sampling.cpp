#include "sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "error.h"

namespace specedge {

void validate(const SamplingParams& p) {
  if (std::isnan(p.temperature)) fail_arg("temperature must not be NaN");
  if (std::isnan(p.top_p)) fail_arg("top_p must not be NaN");
  if (p.temperature < 0) fail_arg("temperature must be >= 0, got " + std::to_string(p.temperature));
  if (std::isinf(p.temperature)) fail_arg("temperature must be finite");
  if (!(p.top_p > 0 && p.top_p <= 1)) fail_arg("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  if (p.top_k < 0) fail_arg("top_k must be >= 0 (0 disables it), got " + std::to_string(p.top_k));
}

int argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

void probs_from_logits(const float* logits, int n, const SamplingParams& p, std::vector<double>& out) {
  out.assign(size_t(n), 0.0);
  for (int i = 0; i < n; ++i)
    if (std::isnan(logits[i]) || (std::isinf(logits[i]) && logits[i] > 0))
      fail_backend("the model produced NaN or +inf logits");
  if (p.greedy()) {
    out[size_t(argmax(logits, n))] = 1.0;
    return;
  }
  double mx = -INFINITY;
  for (int i = 0; i < n; ++i) mx = std::max(mx, double(logits[i]));
  if (std::isinf(mx)) fail_backend("every logit of a row is -inf, so no token can be chosen");
  std::vector<double> z(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) z[size_t(i)] = (double(logits[i]) - mx) / p.temperature;
  std::vector<char> keep(size_t(n), 1);
  if (p.top_k > 0 && p.top_k < n) {
    std::vector<double> tmp(z);
    std::nth_element(tmp.begin(), tmp.begin() + (n - p.top_k), tmp.end());
    double kth = tmp[size_t(n - p.top_k)];  // k-th largest value
    int count = 0;
    for (int i = 0; i < n; ++i) {
      keep[size_t(i)] = z[size_t(i)] > kth;
      count += keep[size_t(i)];
    }
    for (int i = 0; i < n && count < p.top_k; ++i)
      if (z[size_t(i)] == kth) {
        keep[size_t(i)] = 1;
        ++count;
      }
  }
  double total = 0;
  for (int i = 0; i < n; ++i)
    if (keep[size_t(i)]) {
      out[size_t(i)] = std::exp(z[size_t(i)]);
      total += out[size_t(i)];
    }
  for (double& v : out) v /= total;
  if (p.top_p < 1.0) {
    std::vector<int> order;
    for (int i = 0; i < n; ++i)
      if (out[size_t(i)] > 0) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return out[size_t(a)] > out[size_t(b)]; });
    double cum = 0;
    size_t n_keep = 0;
    for (int id : order) {
      cum += out[size_t(id)];
      if (cum < p.top_p)
        ++n_keep;
      else
        break;
    }
    n_keep = std::min(n_keep + 1, order.size());
    double kept = 0;
    for (size_t i = 0; i < n_keep; ++i) kept += out[size_t(order[i])];
    std::vector<double> res(size_t(n), 0.0);
    for (size_t i = 0; i < n_keep; ++i) res[size_t(order[i])] = out[size_t(order[i])] / kept;
    out.swap(res);
  }
}

int sample(const double* p, int n, Rng& rng) {
  double total = 0;
  for (int i = 0; i < n; ++i) {
    if (!(p[i] >= 0) || std::isinf(p[i])) fail_backend("a probability row is not finite and non-negative");
    total += p[i];
  }
  if (!(total > 0) || std::isinf(total)) fail_backend("a probability row has no mass");
  double u = rng.uniform() * total, cdf = 0;
  int last_nonzero = -1;
  for (int i = 0; i < n; ++i) {
    if (p[i] > 0) last_nonzero = i;
    cdf += p[i];
    if (cdf > u && p[i] > 0) return i;
  }
  return last_nonzero;
}

std::vector<int32_t> verify_greedy(const std::vector<int32_t>& draft, const float* logits, int V) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < draft.size(); ++i) {
    int best = argmax(logits + i * size_t(V), V);
    if (draft[i] != best) {
      out.push_back(best);
      return out;
    }
    out.push_back(draft[i]);
  }
  out.push_back(argmax(logits + draft.size() * size_t(V), V));
  return out;
}

std::vector<int32_t> verify_sampling(const std::vector<int32_t>& draft, const std::vector<double>* q_all,
                                     const std::vector<double>& p_all, int V, Rng& rng) {
  const size_t k = draft.size(), v_n = size_t(V);
  if (V < 1 || p_all.size() != (k + 1) * v_n)
    fail_arg("target probabilities must be [k + 1, V] = [" + std::to_string(k + 1) + ", " + std::to_string(V) +
             "], got " + std::to_string(p_all.size()) + " values");
  if (q_all && q_all->size() != k * v_n)
    fail_arg("draft probabilities must be [k, V] = [" + std::to_string(k) + ", " + std::to_string(V) + "], got " +
             std::to_string(q_all->size()) + " values");
  for (int32_t x : draft)
    if (x < 0 || x >= V)
      fail_arg("draft token " + std::to_string(x) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
  std::vector<int32_t> out;
  std::vector<double> residual(v_n);
  for (size_t i = 0; i < k; ++i) {
    const double* p = p_all.data() + i * v_n;
    const double* q = q_all ? q_all->data() + i * v_n : nullptr;
    int x = draft[i];
    double qx = q ? q[x] : 0.0;
    if (!(qx > 0)) {  // a point mass at x: u < p(x) / 1, and max(p - onehot(x), 0) is p without x
      if (rng.uniform() < p[x]) {
        out.push_back(x);
        continue;
      }
      std::copy(p, p + V, residual.begin());
      residual[size_t(x)] = 0.0;
    } else {
      // u < p/q without dividing; with p(x) >= q(x) this always holds because u < 1.
      if (rng.uniform() * qx < p[x]) {
        out.push_back(x);
        continue;
      }
      for (size_t v = 0; v < v_n; ++v) residual[v] = std::max(p[v] - q[v], 0.0);
    }
    // A rejection implies p(y) > q(y) somewhere; only rounding (p ~= q) can leave no mass, and
    // then p itself is the right fallback.
    double sum = 0;
    for (double r : residual) sum += r;
    out.push_back(sum > 0 ? sample(residual.data(), V, rng) : sample(p, V, rng));
    return out;
  }
  out.push_back(sample(p_all.data() + k * v_n, V, rng));
  return out;
}

}  // namespace specedge
