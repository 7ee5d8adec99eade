// read bandwidth: each of N threads sums its own 256 MiB slice with 32-byte loads; best of 7
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define SLICE (256ull << 20)
static char* buf; static volatile long long sink;
static void* rd(void* p) { const __m256i* a = (const __m256i*)(buf + (size_t)p * SLICE); __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
  for (size_t i = 0; i < SLICE / 32; i += 4) { s0 = _mm256_add_epi64(s0, _mm256_load_si256(a + i)); s1 = _mm256_add_epi64(s1, _mm256_load_si256(a + i + 1)); s2 = _mm256_add_epi64(s2, _mm256_load_si256(a + i + 2)); s3 = _mm256_add_epi64(s3, _mm256_load_si256(a + i + 3)); }
  long long o[4]; _mm256_storeu_si256((__m256i*)o, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3))); sink += o[0]; return 0; }
static double now() { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int c, char** v) { int n = c > 1 ? atoi(v[1]) : 1; buf = aligned_alloc(64, SLICE * n); memset(buf, 1, SLICE * n);
  double best = 1e9; for (int r = 0; r < 7; ++r) { pthread_t t[8]; double t0 = now(); for (long i = 0; i < n; ++i) pthread_create(&t[i], 0, rd, (void*)i);
    for (int i = 0; i < n; ++i) pthread_join(t[i], 0); double d = now() - t0; if (d < best) best = d; }
  printf("threads %d read %.1f GB/s\n", n, SLICE * n / best / 1e9); return 0; }
