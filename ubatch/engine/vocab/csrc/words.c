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

/* Longest-first cover of one word (its text starts with the word-start mark), at most max_len
 * bytes a token, tried only where characters end; the unknown token if a position has no match.
 * Returns the new end of ids, or -1 if cap is short. */
static int64_t wpm_cover(const strtab *t, const uint8_t *s, int64_t len, int64_t max_len, int32_t unk, int32_t *ids,
                         int64_t out, int64_t cap) {
    int64_t at = 0, before = out;
    while (at < len) {
        int64_t end = at + max_len < len ? at + max_len : len;
        int32_t id = -1;
        for (; end > at; end--) {
            if (end < len && (s[end] & 0xC0) == 0x80) continue;
            if ((id = tab_get(t, s + at, end - at)) >= 0) break;
        }
        if (id < 0) { out = before; break; }
        if (out >= cap) return -1;
        ids[out++] = id;
        at = end;
    }
    if (at < len || len == 0) {
        if (out >= cap) return -1;
        ids[out++] = unk;
    }
    return out;
}

int64_t ub_wpm_words(const void *p, const uint8_t *text, const int64_t *woff, int64_t n_words, int64_t max_len,
                     int32_t unk, int32_t *ids, int64_t cap, int32_t *counts) {
    int64_t out = 0;
    for (int64_t w = 0; w < n_words; w++) {
        int64_t next = wpm_cover(p, text + woff[w], woff[w + 1] - woff[w], max_len, unk, ids, out, cap);
        if (next < 0) return -((int64_t) 1 << 40);
        counts[w] = (int32_t) (next - out);
        out = next;
    }
    return out;
}

static int utf8_put(uint8_t *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (uint8_t) cp; return 1; }
    if (cp < 0x800) { o[0] = 0xC0 | cp >> 6; o[1] = 0x80 | (cp & 0x3F); return 2; }
    if (cp < 0x10000) { o[0] = 0xE0 | cp >> 12; o[1] = 0x80 | (cp >> 6 & 0x3F); o[2] = 0x80 | (cp & 0x3F); return 3; }
    o[0] = 0xF0 | cp >> 18; o[1] = 0x80 | (cp >> 12 & 0x3F); o[2] = 0x80 | (cp >> 6 & 0x3F); o[3] = 0x80 | (cp & 0x3F);
    return 4;
}

/* llm_tokenizer_wpm_session over a whole text of code points: cls[cp] says what preprocessing
 * does with one (0 keep as map[cp], 1 whitespace: ends a word, 2 drop, 3 a word of its own) and
 * each word, after the word-start mark U+2581, is covered as ub_wpm_words does. */
int64_t ub_wpm_text(const void *p, const uint32_t *cps, int64_t n, const uint8_t *cls, const uint32_t *map,
                    int64_t max_len, int32_t unk, int32_t *ids, int64_t cap) {
    uint8_t *word = malloc(4 * (size_t) n + 8);
    if (!word) return -((int64_t) 1 << 41);
    int64_t out = 0, len = 3;
    word[0] = 0xE2; word[1] = 0x96; word[2] = 0x81;
#define FLUSH() do { if (len > 3) { out = wpm_cover(p, word, len, max_len, unk, ids, out, cap); len = 3; \
                                    if (out < 0) { free(word); return -((int64_t) 1 << 40); } } } while (0)
    for (int64_t i = 0; i < n; i++) {
        uint32_t cp = cps[i];
        uint8_t k = cls[cp];
        if (k == 2) continue;
        if (k == 1) { FLUSH(); continue; }
        uint32_t ch = map[cp];
        if (k == 3) FLUSH();
        if (ch == 0x20) { FLUSH(); continue; }
        if (ch != 0) len += utf8_put(word + len, ch);
        if (k == 3) FLUSH();
    }
    FLUSH();
#undef FLUSH
    free(word);
    return out;
}

/* ---- Unigram ------------------------------------------------------------------------------- */

/* The token trie as edges in one open-addressing table: an edge (node << 8 | byte) holds its child
 * node and the token the child spells (-1: none) with its score, so a step of the walk reads one
 * slot; the root's edges are a plain array. */
typedef struct {
    uint32_t key;  /* 0 = empty (no key is 0: the root's edges are not here) */
    int32_t child, tok;
    float score;
} edge;

typedef struct {
    int64_t mask, n_keys, n_nodes;
    edge *slot;
    edge root[256];
    int32_t unk;
    double unk_score;
} ugm;

void ub_ugm_free(void *p) {
    ugm *u = p;
    if (!u) return;
    free(u->slot); free(u);
}

static inline const edge *trie_edge(const ugm *u, int32_t node, uint8_t c) {
    if (node == 0) return u->root[c].child >= 0 ? &u->root[c] : NULL;
    uint32_t key = (uint32_t) node << 8 | c;
    for (uint64_t i = hash_u64(key) & u->mask;; i = (i + 1) & u->mask) {
        const edge *e = &u->slot[i];
        if (e->key == 0) return NULL;
        if (e->key == key) return e;
    }
}

static edge *trie_put(ugm *u, edge e) {
    for (uint64_t i = hash_u64(e.key) & u->mask;; i = (i + 1) & u->mask)
        if (u->slot[i].key == 0) { u->slot[i] = e; return &u->slot[i]; }
}

static int trie_grow(ugm *u) {
    int64_t old = u->mask + 1, size = 2 * old;
    edge *slot = u->slot;
    u->slot = calloc(size, sizeof(edge));
    if (!u->slot) { u->slot = slot; return -1; }
    u->mask = size - 1;
    for (int64_t i = 0; i < old; i++) if (slot[i].key) trie_put(u, slot[i]);
    free(slot);
    return 0;
}

/* llama.cpp's token trie: the tokens with keep[id] (normal, user-defined, unused); score per id
 * (float32 values: the file's, or 0 for user-defined tokens) */
void *ub_ugm_new(const uint8_t *blob, const int64_t *off, int64_t n, const uint8_t *keep, const float *score,
                 int32_t unk, double unk_score) {
    ugm *u = calloc(1, sizeof(ugm));
    if (!u) return NULL;
    u->unk = unk; u->unk_score = unk_score;
    u->mask = (1 << 16) - 1;
    u->slot = calloc(u->mask + 1, sizeof(edge));
    if (!u->slot) { ub_ugm_free(u); return NULL; }
    for (int c = 0; c < 256; c++) u->root[c] = (edge) {0, -1, -1, 0.0f};
    u->n_nodes = 1;
    for (int64_t id = 0; id < n; id++) {
        if (!keep[id] || off[id + 1] == off[id]) continue;
        int32_t node = 0;
        edge *e = NULL;
        for (int64_t k = off[id]; k < off[id + 1]; k++) {
            e = (edge *) trie_edge(u, node, blob[k]);
            if (!e) {
                if (u->n_nodes >= (1 << 24)) { ub_ugm_free(u); return NULL; }  /* (keys hold 24-bit nodes) */
                int32_t next = (int32_t) u->n_nodes++;
                if (node == 0) {
                    e = &u->root[blob[k]];
                    *e = (edge) {0, next, -1, 0.0f};
                } else {
                    if (2 * (u->n_keys + 1) > u->mask + 1 && trie_grow(u)) { ub_ugm_free(u); return NULL; }
                    e = trie_put(u, (edge) {(uint32_t) node << 8 | blob[k], next, -1, 0.0f});
                    u->n_keys++;
                }
            }
            node = e->child;
        }
        if (e->tok < 0) { e->tok = (int32_t) id; e->score = score[id]; }  /* the first of equal texts */
    }
    return u;
}

/* llama.cpp's Viterbi pass over one word s[0:n] (n > 0): from each character start (its length
 * by the lead byte), every token the trie walk finds ends a path there; a character no token
 * covers exactly costs the unknown score; the best path is read back with consecutive unknowns
 * as one. best/btok/bfrom hold n + 1 each. Returns the new end of ids, or -1 if cap is short. */
static int64_t ugm_viterbi(const ugm *u, const uint8_t *s, int64_t n, double *best, int32_t *btok, int64_t *bfrom,
                           int32_t *ids, int64_t out, int64_t cap) {
    int64_t before = out;
    for (int64_t i = 0; i <= n; i++) { best[i] = -1.7976931348623157e308; btok[i] = u->unk; bfrom[i] = 0; }
    best[0] = 0.0;
    for (int64_t at = 0; at < n;) {
        int64_t size = utf8_len(s[at]);
        if (size > n - at) size = n - at;
        double here = best[at];
        int whole = 0;
        int32_t node = 0;
        for (int64_t end = at + 1; end <= n; end++) {
            const edge *e = trie_edge(u, node, s[end - 1]);
            if (!e) break;
            node = e->child;
            int32_t tok = e->tok;
            if (tok < 0) continue;
            if (end - at == size) whole = 1;
            double score = here + (double) e->score;
            if (score > best[end]) { best[end] = score; btok[end] = tok; bfrom[end] = at; }
        }
        if (!whole) {
            double score = here + u->unk_score;
            if (score > best[at + size]) { best[at + size] = score; btok[at + size] = u->unk; bfrom[at + size] = at; }
        }
        at += size;
    }
    int prev_unk = 0;  /* read back (reversed), then reverse in place */
    for (int64_t pos = n;;) {
        int32_t tok = btok[pos];
        if (!(prev_unk && tok == u->unk)) {
            if (out >= cap) return -1;
            ids[out++] = tok;
        }
        if (bfrom[pos] == 0) break;
        prev_unk = tok == u->unk;
        pos = bfrom[pos];
    }
    for (int64_t a = before, b = out - 1; a < b; a++, b--) { int32_t t = ids[a]; ids[a] = ids[b]; ids[b] = t; }
    return out;
}

typedef struct { double *best; int32_t *btok; int64_t *bfrom; } dp;

static int dp_alloc(dp *d, int64_t n) {
    d->best = malloc(sizeof(double) * (n + 1));
    d->btok = malloc(sizeof(int32_t) * (n + 1));
    d->bfrom = malloc(sizeof(int64_t) * (n + 1));
    return d->best && d->btok && d->bfrom ? 0 : -1;
}

static void dp_free(dp *d) { free(d->best); free(d->btok); free(d->bfrom); }

/* The Viterbi pass over each word of a batch (ids and counts per word). */
int64_t ub_ugm_words(const void *p, const uint8_t *text, const int64_t *woff, int64_t n_words, int32_t *ids,
                     int64_t cap, int32_t *counts) {
    const ugm *u = p;
    int64_t longest = 0, out = 0;
    for (int64_t w = 0; w < n_words; w++)
        if (woff[w + 1] - woff[w] > longest) longest = woff[w + 1] - woff[w];
    dp d;
    if (dp_alloc(&d, longest)) { dp_free(&d); return -((int64_t) 1 << 41); }
    for (int64_t w = 0; w < n_words; w++) {
        int64_t n = woff[w + 1] - woff[w], next = out;
        if (n > 0) next = ugm_viterbi(u, text + woff[w], n, d.best, d.btok, d.bfrom, ids, out, cap);
        if (next < 0) { out = -((int64_t) 1 << 40); break; }
        counts[w] = (int32_t) (next - out);
        out = next;
    }
    dp_free(&d);
    return out;
}

/* ---- Unigram over a whole normalised text, word by word, with a cache of words ------------- */

typedef struct { int64_t key, ids; int32_t key_len, n_ids; } centry;  /* key_len < 0: empty */

typedef struct {
    int64_t mask, n, max_entries;
    centry *slot;
    uint8_t *keys; int64_t keys_len, keys_cap;
    int32_t *ids; int64_t ids_len, ids_cap;
} wcache;

void *ub_cache_new(int64_t max_entries) {
    wcache *c = calloc(1, sizeof(wcache));
    if (!c) return NULL;
    int64_t size = 16;
    while (size < 2 * max_entries) size <<= 1;
    c->mask = size - 1; c->max_entries = max_entries;
    c->slot = malloc(sizeof(centry) * size);
    if (!c->slot) { free(c); return NULL; }
    for (int64_t i = 0; i < size; i++) c->slot[i].key_len = -1;
    return c;
}

void ub_cache_free(void *p) {
    wcache *c = p;
    if (!c) return;
    free(c->slot); free(c->keys); free(c->ids); free(c);
}

static void cache_clear(wcache *c) {
    for (int64_t i = 0; i <= c->mask; i++) c->slot[i].key_len = -1;
    c->n = c->keys_len = c->ids_len = 0;
}

static centry *cache_find(wcache *c, const uint8_t *s, int64_t n) {  /* the entry, or the empty slot for it */
    for (uint64_t i = hash_bytes(s, n) & c->mask;; i = (i + 1) & c->mask) {
        centry *e = &c->slot[i];
        if (e->key_len < 0 || (e->key_len == n && memcmp(c->keys + e->key, s, n) == 0)) return e;
    }
}

static int grow(void **buf, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 1 << 16;
    while (c < need) c *= 2;
    void *b = realloc(*buf, item * c);
    if (!b) return -1;
    *buf = b; *cap = c;
    return 0;
}

/* The ids of a normalised text cut before each U+2581 (where no token reaches across one, so
 * every path goes through it), each word's ids from the cache or a Viterbi pass, consecutive
 * unknowns merged over the joins too. The cache is emptied when it holds max_entries words. */
int64_t ub_ugm_text(const void *p, void *cp, const uint8_t *text, int64_t n, int32_t *ids, int64_t cap) {
    const ugm *u = p;
    wcache *c = cp;
    dp d;
    if (dp_alloc(&d, n)) { dp_free(&d); return -((int64_t) 1 << 41); }
    int64_t out = 0;
    for (int64_t at = 0; at < n;) {
        int64_t end = at + 1;
        while (end < n && !(text[end] == 0xE2 && end + 2 < n && text[end + 1] == 0x96 && text[end + 2] == 0x81)) end++;
        const uint8_t *w = text + at;
        int64_t len = end - at;
        if (c->n >= c->max_entries) cache_clear(c);
        centry *e = cache_find(c, w, len);
        int64_t first = out;
        if (e->key_len < 0) {
            int64_t next = ugm_viterbi(u, w, len, d.best, d.btok, d.bfrom, ids, out, cap);
            if (next < 0) { out = -((int64_t) 1 << 40); break; }
            out = next;
            if (grow((void **) &c->keys, &c->keys_cap, c->keys_len + len, 1) ||
                grow((void **) &c->ids, &c->ids_cap, c->ids_len + (out - first), sizeof(int32_t))) {
                out = -((int64_t) 1 << 41); break;
            }
            memcpy(c->keys + c->keys_len, w, len);
            memcpy(c->ids + c->ids_len, ids + first, sizeof(int32_t) * (out - first));
            *e = (centry) {c->keys_len, c->ids_len, (int32_t) len, (int32_t) (out - first)};
            c->keys_len += len; c->ids_len += out - first; c->n++;
        } else {
            if (out + e->n_ids > cap) { out = -((int64_t) 1 << 40); break; }
            memcpy(ids + out, c->ids + e->ids, sizeof(int32_t) * e->n_ids);
            out += e->n_ids;
        }
        if (first > 0 && out > first && ids[first] == u->unk && ids[first - 1] == u->unk) {
            memmove(ids + first, ids + first + 1, sizeof(int32_t) * (out - first - 1));
            out--;
        }
        at = end;
    }
    dp_free(&d);
    return out;
}
