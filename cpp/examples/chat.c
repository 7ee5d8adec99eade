/* A small chat over the C API: reads user lines from stdin, streams the answers.
 *   specedge_chat BUNDLE [--threads N]
 * The conversation so far is re-rendered through the bundle's chat format each turn; the
 * runtime reuses the target's cache for the shared prefix. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specedge.h"

static int on_token(void* user, int32_t token, const char* text, size_t len) {
  (void)user;
  (void)token;
  fwrite(text, 1, len, stdout);
  fflush(stdout);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: specedge_chat BUNDLE [--threads N]\n");
    return 2;
  }
  specedge_open_options oo;
  specedge_open_options_init(&oo);
  if (argc >= 4 && strcmp(argv[2], "--threads") == 0) oo.threads = atoi(argv[3]);
  specedge_model* model = NULL;
  if (specedge_open(argv[1], &oo, &model) != SPECEDGE_OK) {
    fprintf(stderr, "error: %s\n", specedge_last_error());
    return 2;
  }
  enum { MAX_TURNS = 64 };
  char* roles[MAX_TURNS * 2];
  char* contents[MAX_TURNS * 2];
  size_t n = 0;
  char line[4096];
  specedge_gen_params gp;
  specedge_gen_params_init(&gp);
  gp.max_new_tokens = 256;
  printf("> ");
  fflush(stdout);
  while (n + 2 <= MAX_TURNS * 2 && fgets(line, sizeof line, stdin)) {
    line[strcspn(line, "\n")] = 0;
    if (!line[0]) { printf("> "); fflush(stdout); continue; }
    roles[n] = strdup("user");
    contents[n] = strdup(line);
    ++n;
    size_t len = 0;
    if (specedge_apply_chat(model, (const char* const*)roles, (const char* const*)contents, n, 1, NULL, 0, &len) != SPECEDGE_OK) {
      fprintf(stderr, "error: %s\n", specedge_last_error());
      break;
    }
    char* prompt = malloc(len + 1);
    specedge_apply_chat(model, (const char* const*)roles, (const char* const*)contents, n, 1, prompt, len + 1, &len);
    size_t n_ids = 0;
    specedge_tokenize(model, prompt, 0, NULL, 0, &n_ids);
    int32_t* ids = malloc(n_ids * sizeof(int32_t));
    specedge_tokenize(model, prompt, 0, ids, n_ids, &n_ids);
    free(prompt);
    specedge_result* r = NULL;
    if (specedge_generate_tokens(model, ids, n_ids, &gp, on_token, NULL, &r) != SPECEDGE_OK) {
      fprintf(stderr, "\nerror: %s\n", specedge_last_error());
      free(ids);
      break;
    }
    free(ids);
    specedge_stats st;
    specedge_result_stats(r, &st);
    roles[n] = strdup("assistant");
    contents[n] = strdup(specedge_result_text(r, NULL));
    ++n;
    printf("\n[%lld tokens, %.1f tok/s, acceptance %.2f]\n> ", (long long)st.tokens, st.tokens_per_s, st.acceptance_rate);
    fflush(stdout);
    specedge_result_free(r);
  }
  for (size_t i = 0; i < n; ++i) { free(roles[i]); free(contents[i]); }
  specedge_close(model);
  return 0;
}
