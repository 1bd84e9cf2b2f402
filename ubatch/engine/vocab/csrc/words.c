/* The per-word loops of BPE, WordPiece and Unigram, as llama.cpp runs them, over a batch of words.
 *
 * Python (words.py) hands over the vocabulary's texts as one blob with offsets and, per call, the
 * words of a text as one buffer with offsets; each function writes the ids of every word and how
 * many each has. Nothing here allocates per word; tables are built once per vocabulary.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define UB_WORDS_ABI 1

int ub_words_abi(void) { return UB_WORDS_ABI; }

static uint64_t hash_bytes(const uint8_t *s, int64_t n) {
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return x;
}

/* ---- text -> id: open addressing over the vocabulary's blob -------------------------------- */

typedef struct {
    const uint8_t *blob;
    const int64_t *off;
    int64_t mask;
    int32_t *slot;
} strtab;

static int32_t tab_get(const strtab *t, const uint8_t *s, int64_t n) {
    for (uint64_t i = hash_bytes(s, n) & t->mask;; i = (i + 1) & t->mask) {
        int32_t id = t->slot[i];
        if (id < 0) return -1;
        if (t->off[id + 1] - t->off[id] == n && memcmp(t->blob + t->off[id], s, n) == 0) return id;
    }
}

/* ids with keep[id] (all if keep is NULL); the first of equal texts wins */
static int tab_init(strtab *t, const uint8_t *blob, const int64_t *off, int64_t n, const uint8_t *keep) {
    int64_t size = 16;
    while (size < 2 * n) size <<= 1;
    t->blob = blob; t->off = off; t->mask = size - 1;
    t->slot = malloc(sizeof(int32_t) * size);
    if (!t->slot) return -1;
    memset(t->slot, 0xff, sizeof(int32_t) * size);
    for (int64_t id = 0; id < n; id++) {
        if (keep && !keep[id]) continue;
        const uint8_t *s = blob + off[id];
        int64_t len = off[id + 1] - off[id];
        uint64_t i = hash_bytes(s, len) & t->mask;
        for (;; i = (i + 1) & t->mask) {
            int32_t o = t->slot[i];
            if (o < 0) { t->slot[i] = (int32_t) id; break; }
            if (off[o + 1] - off[o] == len && memcmp(blob + off[o], s, len) == 0) break;
        }
    }
    return 0;
}

static int utf8_len(uint8_t c) {
    static const int len[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return len[c >> 4];
}

/* ---- BPE ----------------------------------------------------------------------------------- */

typedef struct {
    strtab tok;
    int64_t pmask;
    uint64_t *pkey;  /* (left << 32 | right) + 1; 0 = empty */
    int32_t *prank, *pnew;
    int32_t byte_ids[256];  /* a piece that is no token falls back to these, per byte (-1: none) */
} bpe;

static int32_t pair_get(const bpe *b, int32_t l, int32_t r, int32_t *out_new) {
    uint64_t key = ((uint64_t) (uint32_t) l << 32 | (uint32_t) r) + 1;
    for (uint64_t i = hash_u64(key) & b->pmask;; i = (i + 1) & b->pmask) {
        if (b->pkey[i] == 0) return -1;
        if (b->pkey[i] == key) { *out_new = b->pnew[i]; return b->prank[i]; }
    }
}

void ub_bpe_free(void *p) {
    bpe *b = p;
    if (!b) return;
    free(b->tok.slot); free(b->pkey); free(b->prank); free(b->pnew); free(b);
}

/* Every merge line "a b" (split at its first space after the first byte) must join tokens a and
 * b into the token ab, else NULL (then llama.cpp's loop may merge symbols that are no tokens:
 * the Python loop runs). A repeated line keeps its first rank. */
void *ub_bpe_new(const uint8_t *blob, const int64_t *off, int64_t n, const uint8_t *mblob, const int64_t *moff,
                 int64_t n_merges, const int32_t *byte_ids) {
    bpe *b = calloc(1, sizeof(bpe));
    if (!b || tab_init(&b->tok, blob, off, n, NULL)) { ub_bpe_free(b); return NULL; }
    int64_t size = 16;
    while (size < 2 * n_merges) size <<= 1;
    b->pmask = size - 1;
    b->pkey = calloc(size, sizeof(uint64_t));
    b->prank = malloc(sizeof(int32_t) * size);
    b->pnew = malloc(sizeof(int32_t) * size);
    if (!b->pkey || !b->prank || !b->pnew) { ub_bpe_free(b); return NULL; }
    memcpy(b->byte_ids, byte_ids, sizeof(b->byte_ids));
    uint8_t *joined = NULL;
    int64_t cap = 0;
    for (int64_t m = 0; m < n_merges; m++) {
        const uint8_t *s = mblob + moff[m];
        int64_t len = moff[m + 1] - moff[m], sep = -1;
        for (int64_t k = 1; k < len; k++) if (s[k] == ' ') { sep = k; break; }
        if (sep < 0 || sep + 1 >= len) { free(joined); ub_bpe_free(b); return NULL; }
        int32_t l = tab_get(&b->tok, s, sep), r = tab_get(&b->tok, s + sep + 1, len - sep - 1);
        if (len > cap) { cap = 2 * len; free(joined); joined = malloc(cap); if (!joined) { ub_bpe_free(b); return NULL; } }
        memcpy(joined, s, sep);
        memcpy(joined + sep, s + sep + 1, len - sep - 1);
        int32_t nw = tab_get(&b->tok, joined, len - 1);
        if (l < 0 || r < 0 || nw < 0) { free(joined); ub_bpe_free(b); return NULL; }
        uint64_t key = ((uint64_t) (uint32_t) l << 32 | (uint32_t) r) + 1;
        for (uint64_t i = hash_u64(key) & b->pmask;; i = (i + 1) & b->pmask) {
            if (b->pkey[i] == key) break;
            if (b->pkey[i] == 0) { b->pkey[i] = key; b->prank[i] = (int32_t) m; b->pnew[i] = nw; break; }
        }
    }
    free(joined);
    return b;
}

#define BPE_MAX_SYMBOLS 4096

/* The merge loop of each word (lowest rank first, leftmost on ties) on a list of symbols: their
 * ids and byte spans. ids/counts get each word's result; returns the ids written, or -1 - w if
 * word w is too long (it and those after are left to the caller), or -2^40 if `cap` is short. */
int64_t ub_bpe_words(const void *p, const uint8_t *text, const int64_t *woff, int64_t n_words, int32_t *ids,
                     int64_t cap, int32_t *counts) {
    const bpe *b = p;
    int32_t *sym = malloc(sizeof(int32_t) * 3 * BPE_MAX_SYMBOLS), *rank = sym + BPE_MAX_SYMBOLS;
    int32_t *nw = rank + BPE_MAX_SYMBOLS;
    int64_t *start = malloc(sizeof(int64_t) * (BPE_MAX_SYMBOLS + 1)), out = 0;
    if (!sym || !start) { free(sym); free(start); return -((int64_t) 1 << 41); }
    for (int64_t w = 0; w < n_words; w++) {
        const uint8_t *s = text + woff[w];
        int64_t len = woff[w + 1] - woff[w], n = 0;
        for (int64_t at = 0; at < len; n++) {
            if (n == BPE_MAX_SYMBOLS) { out = -1 - w; goto done; }
            int64_t k = utf8_len(s[at]);
            if (k > len - at) k = len - at;
            start[n] = at;
            sym[n] = tab_get(&b->tok, s + at, k);
            at += k;
        }
        start[n] = len;
        for (int64_t i = 0; i + 1 < n; i++) rank[i] = sym[i] >= 0 && sym[i + 1] >= 0 ? pair_get(b, sym[i], sym[i + 1], &nw[i]) : -1;
        while (n > 1) {
            int64_t best = -1;
            for (int64_t i = 0; i + 1 < n; i++)
                if (rank[i] >= 0 && (best < 0 || rank[i] < rank[best])) best = i;
            if (best < 0) break;
            sym[best] = nw[best];
            memmove(sym + best + 1, sym + best + 2, sizeof(int32_t) * (n - best - 2));
            memmove(start + best + 1, start + best + 2, sizeof(int64_t) * (n - best - 1));
            memmove(rank + best + 1, rank + best + 2, sizeof(int32_t) * (n - best - 2 > 0 ? n - best - 2 : 0));
            memmove(nw + best + 1, nw + best + 2, sizeof(int32_t) * (n - best - 2 > 0 ? n - best - 2 : 0));
            n--;
            if (best > 0) rank[best - 1] = pair_get(b, sym[best - 1], sym[best], &nw[best - 1]);
            if (best + 1 < n) rank[best] = pair_get(b, sym[best], sym[best + 1], &nw[best]);
        }
        int64_t before = out;
        for (int64_t i = 0; i < n; i++) {
            if (sym[i] >= 0) {
                if (out >= cap) { out = -((int64_t) 1 << 40); goto done; }
                ids[out++] = sym[i];
                continue;
            }
            for (int64_t k = start[i]; k < start[i + 1]; k++) {  /* no such token: its bytes */
                int32_t t = b->byte_ids[s[k]];
                if (t < 0) continue;
                if (out >= cap) { out = -((int64_t) 1 << 40); goto done; }
                ids[out++] = t;
            }
        }
        counts[w] = (int32_t) (out - before);
    }
done:
    free(sym); free(start);
    return out;
}

/* ---- WordPiece ----------------------------------------------------------------------------- */

void *ub_wpm_new(const uint8_t *blob, const int64_t *off, int64_t n) {
    strtab *t = calloc(1, sizeof(strtab));
    if (!t || tab_init(t, blob, off, n, NULL)) { if (t) free(t->slot); free(t); return NULL; }
    return t;
}

void ub_tab_free(void *p) {
    strtab *t = p;
    if (t) free(t->slot);
    free(t);
}

/* Longest-first cover of each word (its text already starts with the word-start mark), at most
 * max_len bytes a token; a word with a position no token starts at is the unknown token. Tokens
 * are tried only where characters end (each word is valid UTF-8). */
int64_t ub_wpm_words(const void *p, const uint8_t *text, const int64_t *woff, int64_t n_words, int64_t max_len,
                     int32_t unk, int32_t *ids, int64_t cap, int32_t *counts) {
    const strtab *t = p;
    int64_t out = 0;
    for (int64_t w = 0; w < n_words; w++) {
        const uint8_t *s = text + woff[w];
        int64_t len = woff[w + 1] - woff[w], at = 0, before = out;
        while (at < len) {
            int64_t end = at + max_len < len ? at + max_len : len;
            int32_t id = -1;
            for (; end > at; end--) {
                if (end < len && (s[end] & 0xC0) == 0x80) continue;
                if ((id = tab_get(t, s + at, end - at)) >= 0) break;
            }
            if (id < 0) { out = before; break; }
            if (out >= cap) return -((int64_t) 1 << 40);
            ids[out++] = id;
            at = end;
        }
        if (at < len || len == 0) {
            if (out >= cap) return -((int64_t) 1 << 40);
            ids[out++] = unk;
        }
        counts[w] = (int32_t) (out - before);
    }
    return out;
}
