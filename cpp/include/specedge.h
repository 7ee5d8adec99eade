/* specedge C API: speculative decoding over a specedge bundle (manifest.json + ONNX graphs +
 * tokenizer.json), driven by ONNX Runtime.
 *
 * Conventions
 * - Every function that can fail returns a specedge_status; SPECEDGE_OK is 0. On failure,
 *   specedge_last_error() returns a one-sentence message for the calling thread (valid until the
 *   thread's next specedge call). No C++ exception ever crosses this boundary.
 * - Handles are opaque and may be shared between threads. A specedge_model runs one generation
 *   at a time (it has one KV cache): specedge_generate* calls on one handle from several threads
 *   take turns, each waiting until the one before it returns; a call made from inside a token
 *   callback on the handle that is running it fails with SPECEDGE_ERR_INVALID_ARGUMENT ("the
 *   model is busy"). specedge_tokenize, specedge_detokenize, specedge_apply_chat and the
 *   information functions read only and run concurrently with anything but specedge_close,
 *   which must come after every other call on the handle has returned. Open one handle per
 *   request that must run at the same time. Handles share no state, only ONNX Runtime's
 *   process-wide intra-op thread pool (see specedge_open_options.threads).
 * - Strings are UTF-8, NUL-terminated unless a length is given. Token ids are int32_t.
 */
#ifndef SPECEDGE_H
#define SPECEDGE_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define SPECEDGE_API __declspec(dllexport)
#else
#define SPECEDGE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SPECEDGE_VERSION "0.1.0"
/* The binary interface: the soname is libspecedge.so.<SPECEDGE_ABI_VERSION>. It changes whenever a
 * declaration below changes (a struct's fields above all: the library writes and reads whole
 * structs in the caller's memory), so a program never loads a library with other layouts than its
 * own; cpp/abi.json records each version's declarations (scripts/c_abi.py). Programs that open the
 * library by hand (dlopen, ctypes) compare specedge_abi_version() with the version they were
 * written for. */
#define SPECEDGE_ABI_VERSION 1
#define SPECEDGE_MAX_SPEC_TOKENS 16  /* the largest k (draft tokens per round) */
#define SPECEDGE_SEED_MAX UINT64_MAX /* sampling seeds: 0..2^64-1, as the Python runtime, CLIs and server */

typedef enum specedge_status {
  SPECEDGE_OK = 0,
  SPECEDGE_ERR_INVALID_ARGUMENT = 1, /* a bad parameter or prompt */
  SPECEDGE_ERR_BUNDLE = 2,           /* the bundle is missing, malformed or fails its checksums */
  SPECEDGE_ERR_BACKEND = 3,          /* ONNX Runtime / TensorRT / CUDA could not load or run a graph */
  SPECEDGE_ERR_IO = 4,               /* a file could not be read */
  SPECEDGE_ERR_INTERNAL = 5          /* a bug or out of memory */
} specedge_status;

typedef struct specedge_model specedge_model;   /* a loaded bundle: tokenizer, target, drafter */
typedef struct specedge_result specedge_result; /* one finished generation */

/* ------------------------------------------------------------------ opening a bundle */

typedef struct specedge_open_options {
  const char* backend; /* "ort-cpu" (default when NULL; "auto" means the same here) or "tensorrt": the native
                          TensorRT backend, engines from `specedge build-engines` (a library built without
                          TensorRT refuses it with SPECEDGE_ERR_INVALID_ARGUMENT and the reason) */
  int threads;         /* ONNX Runtime intra-op threads, 0..1024; 0 = ONNX Runtime's default. The first handle
                          opened in the process creates one thread pool of this size (spinning
                          unless allow_spinning is 0); the target and draft sessions of every
                          handle asking for the same threads and spinning run on it. Other
                          values get a pool per session. */
  int spec_tokens;     /* default k (draft tokens per round), 1..16; 0 = the bundle's */
  const char* draft;   /* "model", "ngram", "head" (the bundle's trained draft head, `specedge
                          train-draft`; it runs on ort-cpu beside a target on any backend),
                          or NULL = the bundle's own kind */
  const char* verify;  /* bundle file check: "full" (sha256, default), "size" or "none" */
  int allow_spinning;  /* ONNX Runtime intra-op spinning: -1 = auto (on for the shared pool; on a
                          per-session pool, off when a draft session takes turns with the
                          target), 0 = off, 1 = on */
  int warmup;          /* 1 (default): run each call shape once and measure step costs */
} specedge_open_options;

SPECEDGE_API void specedge_open_options_init(specedge_open_options* opts);
/* Load and validate a bundle. opts may be NULL (defaults). *out is set only on success. */
SPECEDGE_API specedge_status specedge_open(const char* bundle_dir, const specedge_open_options* opts,
                                           specedge_model** out);
SPECEDGE_API void specedge_close(specedge_model* model); /* NULL is allowed */

/* ------------------------------------------------------------------ text */

/* Token ids of `text` (no special tokens added; the bundle's BOS is prepended when add_bos is 1,
 * or when add_bos is -1 and the manifest says add_bos). Writes at most `capacity` ids to `ids`
 * (may be NULL when capacity is 0) and the full count to *n_ids: call twice to size the buffer. */
SPECEDGE_API specedge_status specedge_tokenize(specedge_model* model, const char* text, int add_bos, int32_t* ids,
                                               size_t capacity, size_t* n_ids);
/* Text of `ids` (special tokens skipped). Writes at most capacity - 1 bytes plus a NUL to `buf`
 * and the full length (without NUL) to *len. */
SPECEDGE_API specedge_status specedge_detokenize(specedge_model* model, const int32_t* ids, size_t n_ids, char* buf,
                                                 size_t capacity, size_t* len);
/* The bundle's chat format applied to messages (roles[i], contents[i]); writes like
 * specedge_detokenize. Supported: ChatML-style templates (<|im_start|>) and Gemma-style
 * (<start_of_turn>); anything else is SPECEDGE_ERR_INVALID_ARGUMENT. */
SPECEDGE_API specedge_status specedge_apply_chat(specedge_model* model, const char* const* roles,
                                                 const char* const* contents, size_t n_messages,
                                                 int add_generation_prompt, char* buf, size_t capacity, size_t* len);

/* ------------------------------------------------------------------ generating */

typedef struct specedge_gen_params {
  int max_new_tokens; /* >= 1 (default 128) */
  double temperature; /* 0 = greedy (default) */
  int top_k;          /* 0 = off */
  double top_p;       /* (0, 1]; 1 = off */
  uint64_t seed;      /* used when has_seed; otherwise a seed from the OS */
  int has_seed;
  const char* const* stop; /* stop strings (the text is cut before the first one found) */
  size_t n_stop;
  int spec_tokens; /* k for this request, 1..16; 0 = the model's default */
  int speculative; /* 1 (default): use the drafter; 0: target only */
  int guard;       /* 1 (default): shrink k / fall back to target-only when speculation
                      does not pay */
  int adaptive_k;  /* 0 (default); 1: also move k by the last round, up after a round that
                      accepted every draft, down after one that accepted fewer than half
                      (Python's adaptive_k / --adaptive-k; docs/design.md) */
  int tree;        /* 0 (default); 1: verify a tree of drafted continuations per target call
                      (Python's tree / --tree; docs/design.md "Tree calls"); needs a bundle
                      exported with --tree, else SPECEDGE_ERR_INVALID_ARGUMENT */
} specedge_gen_params;

SPECEDGE_API void specedge_gen_params_init(specedge_gen_params* params);

/* Called once per generated token, in order: the token id and the text that became printable
 * with it (often empty: a character split over tokens, or text held back because it may start
 * a stop string). Return 0 to go on, non-zero to cancel: generation stops with finish reason
 * "cancelled" and the result holds what was generated so far. */
typedef int (*specedge_token_callback)(void* user_data, int32_t token_id, const char* text, size_t text_len);

/* Generate from a text prompt (encoded like specedge_tokenize with add_bos = -1). */
SPECEDGE_API specedge_status specedge_generate(specedge_model* model, const char* prompt,
                                               const specedge_gen_params* params, specedge_token_callback callback,
                                               void* user_data, specedge_result** out);
/* Generate from token ids. */
SPECEDGE_API specedge_status specedge_generate_tokens(specedge_model* model, const int32_t* ids, size_t n_ids,
                                                      const specedge_gen_params* params,
                                                      specedge_token_callback callback, void* user_data,
                                                      specedge_result** out);

typedef struct specedge_stats {
  int64_t tokens; /* generated tokens (no EOS) */
  int64_t prompt_tokens;
  double tokens_per_s;     /* decode speed: (tokens - 1) / decode_s */
  double e2e_tokens_per_s; /* tokens / total_s */
  double ttft_s;           /* prefill and first token */
  double decode_s;
  double total_s;
  double time_draft_s, time_verify_s, time_other_s;
  int speculative;        /* 1 when a drafter was used */
  double acceptance_rate; /* accepted / drafted */
  double mean_accepted;   /* tokens per target call in speculative rounds */
  int64_t target_calls, drafted, accepted;
  int k, k_final; /* k at start and at the end (the guard may shrink it) */
  int fallbacks;  /* times the guard switched to target-only decoding */
  int64_t fallback_tokens;
  int k_shrinks;                /* times the guard lowered k */
  int64_t prefix_reused_tokens; /* prompt tokens whose K/V the previous request left in the cache */
  int64_t accepted_histogram[SPECEDGE_MAX_SPEC_TOKENS + 1]; /* [n]: rounds that accepted n draft tokens */
  int n_accepted_histogram; /* entries used: the most tokens drafted in one round + 1 (0: no round) */
  int64_t k_histogram[SPECEDGE_MAX_SPEC_TOKENS + 1]; /* [k]: speculative rounds that drafted with k */
  double alpha_estimate;                             /* the guard's decayed per-token acceptance estimate at the end */
  int64_t draft_calls;                               /* draft model backend calls (0 for the n-gram drafter) */
  int64_t draft_kv_copied;                           /* draft cache slots copied from the target's K/V (self-draft) */
  int64_t tree_rounds; /* tree rounds judged against their chain (gen params tree; 0 otherwise) */
  int trees_off;       /* 1: the guard turned trees off for the rest of the request */
} specedge_stats;

SPECEDGE_API const int32_t* specedge_result_tokens(const specedge_result* r, size_t* n);
SPECEDGE_API const char* specedge_result_text(const specedge_result* r, size_t* len); /* NUL-terminated */
/* "eos", "stop", "length", "context" or "cancelled" */
SPECEDGE_API const char* specedge_result_finish_reason(const specedge_result* r);
SPECEDGE_API void specedge_result_stats(const specedge_result* r, specedge_stats* stats);
SPECEDGE_API void specedge_result_free(specedge_result* r); /* NULL is allowed */

/* ------------------------------------------------------------------ information */

SPECEDGE_API const char* specedge_last_error(void); /* "" when the last call succeeded */
SPECEDGE_API const char* specedge_status_name(specedge_status s);
SPECEDGE_API const char* specedge_version(void);
SPECEDGE_API int specedge_abi_version(void); /* the library's SPECEDGE_ABI_VERSION */
/* Facts about the loaded bundle. */
SPECEDGE_API int specedge_max_seq(const specedge_model* model);
SPECEDGE_API int specedge_vocab_size(const specedge_model* model);
SPECEDGE_API const char* specedge_drafter_kind(const specedge_model* model); /* "model", "ngram", "head" */

#ifdef __cplusplus
}
#endif
#endif /* SPECEDGE_H */
