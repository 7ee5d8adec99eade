// Logits -> probabilities (temperature, top-k, top-p; float64), sampling, and the verifiers.
// Same rules as specedge/runtime/sampling.py and verify.py: ties go to the lower token id
// everywhere; every random decision draws exactly one uniform from the request's own RNG.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace specedge {

struct SamplingParams {
  double temperature = 0.0;
  int top_k = 0;
  double top_p = 1.0;
  bool greedy() const { return temperature == 0.0; }
};

// Throws SPECEDGE_ERR_INVALID_ARGUMENT (one sentence) on a bad setting.
void validate(const SamplingParams& p);

// Lowest index of the largest value (np.argmax).
int argmax(const float* logits, int n);
// Probability row (size n) of `logits` after temperature, top-k, top-p; one-hot when greedy.
void probs_from_logits(const float* logits, int n, const SamplingParams& p, std::vector<double>& out);

// The request's random generator: a 64-bit Mersenne Twister; uniform() is in [0, 1) with 53 bits.
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  double uniform() { return double(gen_() >> 11) * (1.0 / 9007199254740992.0); }

 private:
  std::mt19937_64 gen_;
};

// Inverse-CDF draw from a non-negative row (need not sum to 1); never returns a zero-mass id.
int sample(const double* p, int n, Rng& rng);

// Greedy verification: accepted draft prefix + the target's own token. rows: [k+1, V] logits.
std::vector<int32_t> verify_greedy(const std::vector<int32_t>& draft, const float* logits, int V);
// Exact speculative sampling (Leviathan et al.); p: [k+1, V] probability rows; q: the [k, V]
// rows the draft tokens were sampled from, or nullptr for a deterministic proposal (an n-gram
// lookup), where each token is a point mass: accept x with probability p(x), otherwise sample p
// without x. A token with q(x) == 0 gets the same rule (verify.py verify_sampling).
std::vector<int32_t> verify_sampling(const std::vector<int32_t>& draft, const std::vector<double>* q,
                                     const std::vector<double>& p, int V, Rng& rng);

}  // namespace specedge
