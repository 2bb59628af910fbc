/* The llama.cpp side of benchmarks/bench_llamacpp.py: one process holding one GGUF model, driven over
 * stdin/stdout so that the benchmark can alternate it with dsv4 while both stay loaded and warm.
 *
 * It measures what bench_llamacpp.py measures for dsv4, through libllama's public C API (llama.h):
 *   decode     a prompt (untimed), then STEPS single-token steps of one sequence; each step is timed
 *              alone: llama_decode + reading the last logits + greedy argmax (dsv4: one engine step,
 *              forward + sampling)
 *   generate   BATCH prompts of LEN tokens in one llama_decode (llama.cpp splits it into ubatches),
 *              greedy first tokens, then NEW-1 batched single-token steps: NEW tokens per sequence,
 *              prefill included, timed as a whole (dsv4: LLM.generate with ignore_eos)
 *   prefill    one llama_decode of N tokens with logits at every position (dsv4: one forward + logits)
 *   logits     the logits of every position of a prompt, written as float32 [N, n_vocab] to a file
 *              (the numerical check against dsv4 before anything is timed)
 *
 * Protocol: one command per line on stdin, one reply line on stdout ("ok ..." or "err <reason>").
 *   ctx N_SEQ N_CTX N_BATCH KV FA    (re)create the context: N_SEQ sequences, N_CTX cells in all, batches
 *                                    of up to N_BATCH tokens (n_ubatch stays llama.cpp's default), KV cache
 *                                    stored as KV = f32 | f16 | bf16, flash attention FA = on | off | auto
 *                                    (llama.cpp's defaults: f16, auto)
 *   decode STEPS N t_0 .. t_{N-1}    -> ok <seconds of step 1> ... <seconds of step STEPS>
 *   generate NEW BATCH LEN t...      -> ok <seconds> <sum of generated token ids>   (BATCH*LEN tokens)
 *   prefill N t_0 .. t_{N-1}         -> ok <seconds>
 *   logits PATH N t_0 .. t_{N-1}     -> ok <n_vocab>
 *   quit
 * Every command starts from an empty memory (llama_memory_clear).
 *
 * Usage: llama_driver MODEL.gguf THREADS [--verbose]
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

/* A command line holds at most this many token ids (64 prompts of 64 tokens is 4096). */
#define MAX_TOKENS (1 << 16)

static int g_verbose = 0;

static void log_cb(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static llama_token argmax(const float *logits, int n_vocab) {
    int best = 0;
    for (int i = 1; i < n_vocab; ++i)
        if (logits[i] > logits[best]) best = i;
    return best;
}

/* Fill `batch` with tokens[0..n) of sequence `seq` at positions pos0.., logits where `all_logits` or on the last. */
static void fill(struct llama_batch *batch, const llama_token *tokens, int n, llama_seq_id seq, llama_pos pos0,
                 int all_logits) {
    for (int i = 0; i < n; ++i) {
        int j = batch->n_tokens++;
        batch->token[j] = tokens[i];
        batch->pos[j] = pos0 + i;
        batch->n_seq_id[j] = 1;
        batch->seq_id[j][0] = seq;
        batch->logits[j] = (int8_t)(all_logits || i == n - 1);
    }
}

struct driver {
    struct llama_model *model;
    struct llama_context *ctx;
    int n_vocab;
    int threads;
    int n_seq;
    int n_batch;
};

static int decode_or_err(struct driver *d, struct llama_batch batch) {
    int rc = llama_decode(d->ctx, batch);
    if (rc != 0) {
        printf("err llama_decode returned %d for a batch of %d tokens\n", rc, batch.n_tokens);
        return 1;
    }
    llama_synchronize(d->ctx);
    return 0;
}

static int cmd_ctx(struct driver *d, int n_seq, int n_ctx, int n_batch, enum ggml_type kv_type,
                   enum llama_flash_attn_type flash_attn) {
    if (d->ctx) llama_free(d->ctx);
    struct llama_context_params p = llama_context_default_params();
    p.n_ctx = (uint32_t)n_ctx;
    p.n_batch = (uint32_t)n_batch;
    p.n_seq_max = (uint32_t)n_seq;
    p.n_threads = d->threads;
    p.n_threads_batch = d->threads;
    /* Separate per-sequence caches: the sequences share no prefix (llama.h's advice for n_seq_max > 1). */
    p.kv_unified = false;
    p.type_k = kv_type;
    p.type_v = kv_type;
    p.flash_attn_type = flash_attn;
    p.no_perf = true;
    d->ctx = llama_init_from_model(d->model, p);
    if (!d->ctx) {
        printf("err could not create a context (n_seq %d, n_ctx %d, n_batch %d)\n", n_seq, n_ctx, n_batch);
        return 1;
    }
    d->n_seq = n_seq;
    d->n_batch = n_batch;
    printf("ok\n");
    return 0;
}

static int cmd_decode(struct driver *d, int steps, const llama_token *prompt, int n) {
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    fill(&batch, prompt, n, 0, 0, 0);
    int rc = decode_or_err(d, batch);
    llama_batch_free(batch);
    if (rc) return rc;
    llama_token token = argmax(llama_get_logits_ith(d->ctx, -1), d->n_vocab);
    double *times = malloc(sizeof(double) * (size_t)steps);
    struct llama_batch one = llama_batch_init(1, 0, 1);
    for (int s = 0; s < steps && rc == 0; ++s) {
        one.n_tokens = 0;
        fill(&one, &token, 1, 0, n + s, 0);
        double t0 = now_s();
        rc = decode_or_err(d, one);
        if (rc == 0) token = argmax(llama_get_logits_ith(d->ctx, -1), d->n_vocab);
        times[s] = now_s() - t0;
    }
    llama_batch_free(one);
    if (rc == 0) {
        printf("ok");
        for (int s = 0; s < steps; ++s) printf(" %.9f", times[s]);
        printf("\n");
    }
    free(times);
    return rc;
}

static int cmd_generate(struct driver *d, int new_tokens, int batch_size, int len, const llama_token *tokens) {
    if (batch_size > d->n_seq || batch_size * len > d->n_batch) {
        printf("err generate: %d prompts of %d tokens do not fit the context (n_seq %d, n_batch %d)\n", batch_size,
               len, d->n_seq, d->n_batch);
        return 1;
    }
    struct llama_batch batch = llama_batch_init(batch_size * len, 0, 1);
    llama_token *next = malloc(sizeof(llama_token) * (size_t)batch_size);
    long checksum = 0;
    int rc = 0;
    double t0 = now_s();
    for (int b = 0; b < batch_size; ++b) fill(&batch, tokens + (size_t)b * len, len, b, 0, 0);
    rc = decode_or_err(d, batch);
    for (int step = 0; rc == 0 && step < new_tokens; ++step) {
        /* llama_get_logits_ith takes the batch index: sequence b's last prompt token, then its one token. */
        for (int b = 0; b < batch_size; ++b) {
            next[b] = argmax(llama_get_logits_ith(d->ctx, step == 0 ? (b + 1) * len - 1 : b), d->n_vocab);
            checksum += next[b];
        }
        if (step == new_tokens - 1) break;  /* the last token needs no forward */
        batch.n_tokens = 0;
        for (int b = 0; b < batch_size; ++b) fill(&batch, &next[b], 1, b, len + step, 0);
        rc = decode_or_err(d, batch);
    }
    double seconds = now_s() - t0;
    if (rc == 0) printf("ok %.9f %ld\n", seconds, checksum);
    llama_batch_free(batch);
    free(next);
    return rc;
}

static int cmd_prefill(struct driver *d, const llama_token *tokens, int n) {
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    double t0 = now_s();
    fill(&batch, tokens, n, 0, 0, 1);
    int rc = decode_or_err(d, batch);
    double seconds = now_s() - t0;
    if (rc == 0) printf("ok %.9f\n", seconds);
    llama_batch_free(batch);
    return rc;
}

static int cmd_logits(struct driver *d, const char *path, const llama_token *tokens, int n) {
    struct llama_batch batch = llama_batch_init(n, 0, 1);
    fill(&batch, tokens, n, 0, 0, 1);
    int rc = decode_or_err(d, batch);
    llama_batch_free(batch);
    if (rc) return rc;
    FILE *f = fopen(path, "wb");
    if (!f) {
        printf("err cannot write %s\n", path);
        return 1;
    }
    for (int i = 0; i < n; ++i) fwrite(llama_get_logits_ith(d->ctx, i), sizeof(float), (size_t)d->n_vocab, f);
    fclose(f);
    printf("ok %d\n", d->n_vocab);
    return 0;
}

/* Parse `count` token ids from strtok's current line into out; returns 0 on success. */
static int read_tokens(llama_token *out, long count, int n_vocab) {
    if (count <= 0 || count > MAX_TOKENS) return 1;
    for (long i = 0; i < count; ++i) {
        char *tok = strtok(NULL, " \t\n");
        if (!tok) return 1;
        long v = strtol(tok, NULL, 10);
        if (v < 0 || v >= n_vocab) return 1;
        out[i] = (llama_token)v;
    }
    return 0;
}

static long next_int(void) {
    char *tok = strtok(NULL, " \t\n");
    return tok ? strtol(tok, NULL, 10) : -1;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS [--verbose]\n", argv[0]);
        return 2;
    }
    g_verbose = argc > 3 && strcmp(argv[3], "--verbose") == 0;
    llama_log_set(log_cb, NULL);
    llama_backend_init();
    struct driver d = {0};
    d.threads = atoi(argv[2]);
    struct llama_model_params mp = llama_model_default_params();
    d.model = llama_model_load_from_file(argv[1], mp);
    if (!d.model) {
        fprintf(stderr, "llama_driver: cannot load %s\n", argv[1]);
        return 1;
    }
    d.n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(d.model));
    printf("ready %d\n", d.n_vocab);
    fflush(stdout);

    size_t line_cap = 0;
    char *line = NULL;
    llama_token *tokens = malloc(sizeof(llama_token) * MAX_TOKENS);
    while (getline(&line, &line_cap, stdin) > 0) {
        char *cmd = strtok(line, " \t\n");
        if (!cmd) continue;
        if (strcmp(cmd, "quit") == 0) break;
        if (strcmp(cmd, "ctx") == 0) {
            long n_seq = next_int(), n_ctx = next_int(), n_batch = next_int();
            char *kv = strtok(NULL, " \t\n"), *fa = strtok(NULL, " \t\n");
            enum ggml_type kv_type = GGML_TYPE_COUNT;
            if (kv && strcmp(kv, "f32") == 0) kv_type = GGML_TYPE_F32;
            if (kv && strcmp(kv, "f16") == 0) kv_type = GGML_TYPE_F16;
            if (kv && strcmp(kv, "bf16") == 0) kv_type = GGML_TYPE_BF16;
            int flash = -2; /* not given */
            if (fa && strcmp(fa, "on") == 0) flash = LLAMA_FLASH_ATTN_TYPE_ENABLED;
            if (fa && strcmp(fa, "off") == 0) flash = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            if (fa && strcmp(fa, "auto") == 0) flash = LLAMA_FLASH_ATTN_TYPE_AUTO;
            if (n_seq <= 0 || n_ctx <= 0 || n_batch <= 0 || kv_type == GGML_TYPE_COUNT || flash == -2)
                printf("err ctx N_SEQ N_CTX N_BATCH f32|f16|bf16 on|off|auto\n");
            else
                cmd_ctx(&d, (int)n_seq, (int)n_ctx, (int)n_batch, kv_type, (enum llama_flash_attn_type)flash);
        } else if (!d.ctx) {
            printf("err no context: send 'ctx N_SEQ N_CTX N_BATCH KV FA' first\n");
        } else {
            llama_memory_clear(llama_get_memory(d.ctx), true);
            if (strcmp(cmd, "decode") == 0) {
                long steps = next_int(), n = next_int();
                if (steps <= 0 || read_tokens(tokens, n, d.n_vocab)) printf("err decode STEPS N t_0 .. t_{N-1}\n");
                else cmd_decode(&d, (int)steps, tokens, (int)n);
            } else if (strcmp(cmd, "generate") == 0) {
                long new_tokens = next_int(), batch = next_int(), len = next_int();
                if (new_tokens <= 0 || batch <= 0 || len <= 0 || read_tokens(tokens, batch * len, d.n_vocab))
                    printf("err generate NEW BATCH LEN followed by BATCH*LEN token ids\n");
                else cmd_generate(&d, (int)new_tokens, (int)batch, (int)len, tokens);
            } else if (strcmp(cmd, "prefill") == 0) {
                long n = next_int();
                if (read_tokens(tokens, n, d.n_vocab)) printf("err prefill N t_0 .. t_{N-1}\n");
                else cmd_prefill(&d, tokens, (int)n);
            } else if (strcmp(cmd, "logits") == 0) {
                char *path = strtok(NULL, " \t\n");
                long n = next_int();
                if (!path || read_tokens(tokens, n, d.n_vocab)) printf("err logits PATH N t_0 .. t_{N-1}\n");
                else cmd_logits(&d, path, tokens, (int)n);
            } else {
                printf("err unknown command '%s'\n", cmd);
            }
        }
        fflush(stdout);
    }
    free(tokens);
    free(line);
    if (d.ctx) llama_free(d.ctx);
    llama_model_free(d.model);
    llama_backend_free();
    return 0;
}
