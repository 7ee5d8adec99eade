/* A chat over the C API that behaves like `specedge chat` (specedge/cli/chat.py):
 *   specedge_chat BUNDLE [--system TEXT] [--max-new-tokens N] [--threads N] [--stats]
 * One user message per input line; /reset clears the history, /exit (or /quit, or end of input)
 * leaves. Answers stream to stdout; the prompt marker, notes and stats go to stderr, so a
 * conversation can be piped in and the answers piped out. When the conversation outgrows the
 * context, the oldest exchanges are dropped (the system message stays); a message that does not
 * fit on its own is refused with an error line and the chat goes on. Ctrl-C stops an answer;
 * at the prompt it leaves. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "specedge.h"

static const char* HELP = "commands: /reset clears the history, /exit leaves (so does end of input)";
static const char* USAGE =
    "usage: specedge_chat BUNDLE [--system TEXT] [--max-new-tokens N] [--threads N] [--stats]\n"
    "Chat with a bundle's model: history and chat template, answers streamed to stdout.\n";

static volatile sig_atomic_t interrupted = 0;

static void on_sigint(int sig) {
  (void)sig;
  interrupted = 1;
}

/* The first write to stdout that failed: EPIPE (the reader left) ends the chat quietly, as
 * `specedge chat`; any other (a full disk) ends it with one error line and exit code 74. */
static int out_errno = 0;

static int put_out(const char* text, size_t len) {
  if (out_errno) return -1;
  errno = 0;
  if ((len && fwrite(text, 1, len, stdout) != len) || fflush(stdout) != 0) {
    out_errno = errno ? errno : EIO;
    return -1;
  }
  return 0;
}

static int on_token(void* user, int32_t token, const char* text, size_t len) {
  (void)user;
  (void)token;
  return (put_out(text, len) || interrupted) ? 1 : 0; /* non-zero cancels the generation */
}

typedef struct {
  char** roles;
  char** contents;
  size_t n, cap;
} history;

static int push(history* h, const char* role, const char* content) {
  if (h->n == h->cap) {
    size_t cap = h->cap ? 2 * h->cap : 16;
    char** r = realloc(h->roles, cap * sizeof *r);
    if (!r) return -1;
    h->roles = r;
    char** c = realloc(h->contents, cap * sizeof *c);
    if (!c) return -1;
    h->contents = c;
    h->cap = cap;
  }
  h->roles[h->n] = strdup(role);
  h->contents[h->n] = strdup(content);
  if (!h->roles[h->n] || !h->contents[h->n]) return -1;
  ++h->n;
  return 0;
}

static void drop(history* h, size_t from, size_t count) {
  for (size_t i = from; i < from + count; ++i) {
    free(h->roles[i]);
    free(h->contents[i]);
  }
  memmove(h->roles + from, h->roles + from + count, (h->n - from - count) * sizeof *h->roles);
  memmove(h->contents + from, h->contents + from + count, (h->n - from - count) * sizeof *h->contents);
  h->n -= count;
}

/* The conversation rendered with the chat template and tokenized; NULL (with the error set) on failure. */
static int32_t* render(specedge_model* m, const history* h, size_t* n_ids) {
  size_t len = 0;
  const char* const* roles = (const char* const*)h->roles;
  const char* const* contents = (const char* const*)h->contents;
  if (specedge_apply_chat(m, roles, contents, h->n, 1, NULL, 0, &len) != SPECEDGE_OK) return NULL;
  char* prompt = malloc(len + 1);
  if (!prompt) return NULL;
  int32_t* ids = NULL;
  if (specedge_apply_chat(m, roles, contents, h->n, 1, prompt, len + 1, &len) == SPECEDGE_OK &&
      specedge_tokenize(m, prompt, 0, NULL, 0, n_ids) == SPECEDGE_OK && (ids = malloc((*n_ids + 1) * sizeof *ids)) &&
      specedge_tokenize(m, prompt, 0, ids, *n_ids, n_ids) != SPECEDGE_OK) {
    free(ids);
    ids = NULL;
  }
  free(prompt);
  return ids;
}

/* Drop the oldest user + assistant pairs until the conversation leaves room to answer (as chat.py). */
static int32_t* fit_history(specedge_model* m, history* h, size_t n_system, size_t* n_ids) {
  int max_seq = specedge_max_seq(m);
  size_t room = (size_t)(max_seq / 8 > 16 ? max_seq / 8 : 16);
  for (;;) {
    int32_t* ids = render(m, h, n_ids);
    if (!ids || *n_ids + room <= (size_t)max_seq || h->n <= n_system + 1) return ids;
    free(ids);
    drop(h, n_system, 2);
  }
}

static void print_stats(specedge_model* m, const specedge_result* r) {
  specedge_stats st;
  specedge_result_stats(r, &st);
  fprintf(stderr, "stats: %lld tokens | %.1f tok/s | ttft %.0f ms", (long long)st.tokens, st.tokens_per_s,
          st.ttft_s * 1000.0);
  if (st.speculative) {
    fprintf(stderr, " | %s draft | acceptance %.2f | %.2f tokens/target call | k %d", specedge_drafter_kind(m),
            st.acceptance_rate, st.mean_accepted, st.k);
    if (st.k_final != st.k) fprintf(stderr, "->%d", st.k_final);
    fprintf(stderr, " | draft %.2fs / verify %.2fs / other %.2fs", st.time_draft_s, st.time_verify_s, st.time_other_s);
    if (st.fallbacks)
      fprintf(stderr, " | %d fallback(s) to target-only (%lld tokens)", st.fallbacks, (long long)st.fallback_tokens);
  } else {
    fprintf(stderr, " | target only");
  }
  fprintf(stderr, " | finish %s\n", specedge_result_finish_reason(r));
}

static int parse_int(const char* opt, const char* value, int min, int* out) {
  char* end = NULL;
  errno = 0;
  long v = value ? strtol(value, &end, 10) : 0;
  if (!value || !*value || *end || errno || v < min || v > 1000000) {
    fprintf(stderr, "error: %s needs an integer from %d to 1000000, got '%s'\n", opt, min, value ? value : "");
    return -1;
  }
  *out = (int)v;
  return 0;
}

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN); /* a reader that leaves makes writes fail (EPIPE) instead of killing us */
  const char* bundle = NULL;
  const char* system = NULL;
  int threads = 0, max_new = 512, stats = 0;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      printf("%s%s.\n", USAGE, HELP);
      return 0;
    } else if (!strcmp(a, "--system") && i + 1 < argc) {
      system = argv[++i];
    } else if (!strcmp(a, "--threads") || !strcmp(a, "--max-new-tokens")) {
      if (parse_int(a, i + 1 < argc ? argv[i + 1] : NULL, 1, !strcmp(a, "--threads") ? &threads : &max_new)) return 2;
      ++i;
    } else if (!strcmp(a, "--stats")) {
      stats = 1;
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "error: unrecognized argument %s (or it needs a value); see --help\n", a);
      return 2;
    } else if (!bundle) {
      bundle = a;
    } else {
      fprintf(stderr, "error: unexpected argument '%s'; see --help\n", a);
      return 2;
    }
  }
  if (!bundle) {
    fprintf(stderr, "error: the bundle folder is required; see --help\n");
    return 2;
  }
  specedge_open_options oo;
  specedge_open_options_init(&oo);
  oo.threads = threads;
  specedge_model* model = NULL;
  if (specedge_open(bundle, &oo, &model) != SPECEDGE_OK) {
    fprintf(stderr, "error: %s\n", specedge_last_error());
    return 2;
  }
  /* No SA_RESTART: Ctrl-C at the prompt ends the read (and so the chat). */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);

  specedge_gen_params gp;
  specedge_gen_params_init(&gp);
  gp.max_new_tokens = max_new;
  history h = {0};
  size_t n_system = 0;
  int rc = 0;
  if (system) {
    if (push(&h, "system", system)) goto oom;
    n_system = 1;
  }
  const int tty = isatty(STDIN_FILENO);
  if (tty) fprintf(stderr, "specedge chat — %s\n", HELP);
  char* line = NULL;
  size_t line_cap = 0;
  for (;;) {
    if (tty) {
      fprintf(stderr, "> ");
      fflush(stderr);
    }
    interrupted = 0;
    ssize_t got = getline(&line, &line_cap, stdin);
    if (got < 0) { /* end of input, or Ctrl-C at the prompt */
      if (interrupted) fputc('\n', stderr);
      break;
    }
    line[strcspn(line, "\r\n")] = 0;
    const char* cmd = line;
    while (*cmd == ' ' || *cmd == '\t') ++cmd;
    size_t cmd_len = strlen(cmd);
    while (cmd_len && (cmd[cmd_len - 1] == ' ' || cmd[cmd_len - 1] == '\t')) --cmd_len;
    if (!cmd_len) continue;
    if ((cmd_len == 5 && !strncmp(cmd, "/exit", 5)) || (cmd_len == 5 && !strncmp(cmd, "/quit", 5))) break;
    if (cmd_len == 6 && !strncmp(cmd, "/reset", 6)) {
      drop(&h, n_system, h.n - n_system);
      fprintf(stderr, "(history cleared)\n");
      continue;
    }
    if (cmd[0] == '/' && !memchr(cmd, ' ', cmd_len)) {
      fprintf(stderr, "unknown command %.*s; %s\n", (int)cmd_len, cmd, HELP);
      continue;
    }
    if (push(&h, "user", line)) goto oom;
    size_t n_ids = 0;
    int32_t* ids = fit_history(model, &h, n_system, &n_ids);
    specedge_result* r = NULL;
    specedge_status s =
        ids ? specedge_generate_tokens(model, ids, n_ids, &gp, on_token, NULL, &r) : SPECEDGE_ERR_INVALID_ARGUMENT;
    free(ids);
    if (s != SPECEDGE_OK) {
      fprintf(stderr, "error: %s\n", specedge_last_error());
      drop(&h, h.n - 1, 1);
      if (s == SPECEDGE_ERR_INVALID_ARGUMENT) continue; /* this message alone does not fit, or is not text */
      rc = 2;
      break;
    }
    if (put_out("\n", 1)) {
      specedge_result_free(r);
      break;
    }
    const char* reason = specedge_result_finish_reason(r);
    if (!strcmp(reason, "cancelled")) {
      fprintf(stderr, "(interrupted)\n");
      drop(&h, h.n - 1, 1);
    } else {
      if (push(&h, "assistant", specedge_result_text(r, NULL))) goto oom;
      if (!strcmp(reason, "context")) fprintf(stderr, "(the context is full: /reset to start over)\n");
      if (stats) print_stats(model, r);
    }
    specedge_result_free(r);
  }
  if (out_errno && out_errno != EPIPE) {
    fprintf(stderr, "error: cannot write to standard output: %s\n", strerror(out_errno));
    rc = 74; /* an output that could not be written (docs/security.md) */
  }
  goto done;
oom:
  fprintf(stderr, "error: out of memory\n");
  rc = 1;
done:
  free(line);
  drop(&h, 0, h.n);
  free(h.roles);
  free(h.contents);
  specedge_close(model);
  return rc;
}
