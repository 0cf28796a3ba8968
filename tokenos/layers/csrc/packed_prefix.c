/* The packed-prefix cache of cascade attention: see packed_prefix.h. */
#include "packed_prefix.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define PREFIX_STALE_CALLS 4096

static prefix_entry **pc_entries; /* each entry its own allocation: dropping one moves no other */
/* Each entry's first page as it was packed, side by side with pc_entries: a lookup reads these
 * contiguous keys and touches only the entries that may match (a scan of 240 entries' own structs,
 * the leftovers of earlier requests, cost 3.7 us a speculative verify call in cache misses). */
typedef struct {
    const void *cache;
    int64_t epoch0;
    int32_t page0;
} prefix_key;
static prefix_key *pc_keys;
static int pc_count, pc_cap;
static int64_t pc_bytes, pc_limit = -1, pc_hits, pc_misses, pc_grown;
static uint64_t pc_clock;
static pthread_mutex_t pc_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t prefix_limit(void) {
    if (pc_limit < 0) {
        const char *env = getenv("TOKENOS_CASCADE_CACHE_MB");
        pc_limit = (env && *env ? atoll(env) : 256) << 20;
    }
    return pc_limit;
}

/* Whether e holds the first pages of a group over `tokens` tokens (whole pages): every page both
 * cover is the same page, at the epoch e packed it at. */
static int prefix_matches(const prefix_entry *e, const void *cache, int64_t page_stride, int block_size,
                          int num_kv_heads, int d, int tokens, const int32_t *pages, const int64_t *epochs) {
    if (e->cache != cache || e->page_stride != page_stride || e->block_size != block_size
        || e->num_kv_heads != num_kv_heads || e->d != d)
        return 0;
    const int n = e->npages < tokens / block_size ? e->npages : tokens / block_size;
    for (int i = 0; i < n; i++)
        if (e->pages[i] != pages[i] || e->epochs[i] != epochs[pages[i]]) return 0;
    return 1;
}

static void prefix_drop(int i) {
    prefix_entry *e = pc_entries[i];
    pc_bytes -= e->bytes;
    free(e->kv);
    free(e->epochs);
    free(e);
    pc_entries[i] = pc_entries[--pc_count];
    pc_keys[i] = pc_keys[pc_count];
}

/* Room for `bytes` more: stale entries go, then the least recently used ones not in use this call. */
static int prefix_make_room(int64_t bytes) {
    for (int i = pc_count - 1; i >= 0; i--)
        if (pc_entries[i]->used + PREFIX_STALE_CALLS < pc_clock) prefix_drop(i);
    while (pc_bytes + bytes > prefix_limit()) {
        int lru = -1;
        for (int i = 0; i < pc_count; i++)
            if (pc_entries[i]->used < pc_clock && (lru < 0 || pc_entries[i]->used < pc_entries[lru]->used)) lru = i;
        if (lru < 0) return 0;
        prefix_drop(lru);
    }
    return 1;
}

/* Room for `tiles` tiles per KV head (and the pages they cover), keeping the packed tiles of the first
 * `keep` tokens; 0 when the cache has no room. */
static int prefix_reserve(prefix_entry *e, int64_t tiles, int64_t tile_elems, int keep) {
    if (tiles <= e->cap_tiles) return 1;
    const int64_t cap = tiles + (tiles / 4 > 4 ? tiles / 4 : 4);
    const int64_t bytes = (int64_t)sizeof(uint32_t) * 2 * cap * e->num_kv_heads * tile_elems;
    if (!prefix_make_room(bytes - e->bytes)) return 0;
    uint32_t *kv = (uint32_t *)malloc((size_t)bytes);
    const int64_t full = keep / PREFIX_TILE_KEYS, old = prefix_entry_elems(e, tile_elems), now = cap * e->num_kv_heads * tile_elems;
    for (int plane = 0; plane < 2 && e->kv; plane++) /* K, then V */
        for (int kh = 0; kh < e->num_kv_heads; kh++)
            memcpy(kv + plane * now + kh * cap * tile_elems, e->kv + plane * old + kh * e->cap_tiles * tile_elems,
                   sizeof(uint32_t) * (size_t)(full * tile_elems));
    free(e->kv);
    const int cap_pages = (int)(cap * PREFIX_TILE_KEYS / e->block_size);
    int64_t *epochs = (int64_t *)malloc((sizeof(int64_t) + sizeof(int32_t)) * (size_t)cap_pages);
    int32_t *pages = (int32_t *)(epochs + cap_pages);
    if (e->npages) {
        memcpy(epochs, e->epochs, sizeof(int64_t) * (size_t)e->npages);
        memcpy(pages, e->pages, sizeof(int32_t) * (size_t)e->npages);
    }
    free(e->epochs);
    pc_bytes += bytes - e->bytes;
    *e = (prefix_entry){e->cache, e->page_stride, e->block_size, e->num_kv_heads, e->d, e->tokens, e->npages,
                        cap_pages, cap, epochs, pages, kv, bytes, e->used};
    return 1;
}

/* A new, empty entry for a group starting on page0 at epoch0 (NULL: no room for it). */
static prefix_entry *prefix_new(const void *cache, int64_t page_stride, int block_size, int num_kv_heads, int d,
                                int64_t tiles, int64_t tile_elems, int32_t page0, int64_t epoch0) {
    prefix_entry *e = (prefix_entry *)malloc(sizeof(prefix_entry));
    *e = (prefix_entry){cache, page_stride, block_size, num_kv_heads, d, 0, 0, 0, 0, NULL, NULL, NULL, 0, pc_clock};
    if (!prefix_reserve(e, tiles, tile_elems, 0)) {
        free(e);
        return NULL;
    }
    if (pc_count == pc_cap) {
        pc_cap = pc_cap ? 2 * pc_cap : 64;
        pc_entries = (prefix_entry **)realloc(pc_entries, sizeof(prefix_entry *) * (size_t)pc_cap);
        pc_keys = (prefix_key *)realloc(pc_keys, sizeof(prefix_key) * (size_t)pc_cap);
    }
    pc_keys[pc_count] = (prefix_key){cache, epoch0, page0};
    pc_entries[pc_count++] = e;
    return e;
}

prefix_entry *prefix_entry_for(const void *cache, int64_t page_stride, int block_size, int num_kv_heads,
                                      int d, int tokens, const int32_t *pages, const int64_t *epochs,
                                      int64_t tile_elems, int create, int64_t *from) {
    const int64_t tiles = (tokens + PREFIX_TILE_KEYS - 1) / PREFIX_TILE_KEYS;
    prefix_entry *best = NULL;
    const int32_t page0 = pages[0];
    const int64_t epoch0 = epochs[page0];
    for (int i = 0; i < pc_count; i++) {
        const prefix_key *key = &pc_keys[i];
        if (key->cache != cache || key->page0 != page0) continue;
        if (key->epoch0 != epoch0) {
            /* Its first page, this group's, has been handed to a request since (epochs never repeat):
             * it can never match again, so it goes now rather than when it turns stale. Only entries
             * of this group's first page are judged: another page's epoch may lie past the end of this
             * call's epochs, where a freed pool's address came back with fewer pages. */
            if (pc_entries[i]->used != pc_clock) prefix_drop(i--);
            continue;
        }
        prefix_entry *e = pc_entries[i];
        if (e->used == pc_clock || !prefix_matches(e, cache, page_stride, block_size, num_kv_heads, d, tokens, pages,
                                                   epochs))
            continue;
        if (!best || e->tokens > best->tokens) best = e;
        if (best->tokens >= tokens) break;
    }
    if (best && best->tokens >= tokens) {
        best->used = pc_clock;
        *from = tiles;
        pc_hits++;
        return best;
    }
    if (best) {
        best->used = pc_clock;
        if (!prefix_reserve(best, tiles, tile_elems, best->tokens)) return NULL;
        *from = best->tokens / PREFIX_TILE_KEYS;
        pc_grown++;
    } else {
        if (!create) return NULL;
        best = prefix_new(cache, page_stride, block_size, num_kv_heads, d, tiles, tile_elems, page0, epoch0);
        if (!best) return NULL;
        *from = 0;
        pc_misses++;
    }
    for (int i = best->npages; i < tokens / block_size; i++) {
        best->pages[i] = pages[i];
        best->epochs[i] = epochs[pages[i]];
    }
    best->npages = tokens / block_size;
    best->tokens = tokens;
    return best;
}

/* Entries, bytes, and the groups that found their prefix packed (hits), packed it anew (misses) or
 * packed only the pages it had grown by (grown) since the last clear; and a way to empty it. */
void cascade_cache_stats(int64_t *out) {
    pthread_mutex_lock(&pc_lock);
    out[0] = pc_count, out[1] = pc_bytes, out[2] = pc_hits, out[3] = pc_misses, out[4] = pc_grown;
    pthread_mutex_unlock(&pc_lock);
}

void cascade_cache_clear(void) {
    pthread_mutex_lock(&pc_lock);
    while (pc_count) prefix_drop(pc_count - 1);
    pc_hits = pc_misses = pc_grown = 0;
    pthread_mutex_unlock(&pc_lock);
}

/* The bound in bytes (0: off; negative: TOKENOS_CASCADE_CACHE_MB again); entries past it go now. */
void cascade_cache_set_limit(int64_t bytes) {
    pthread_mutex_lock(&pc_lock);
    pc_limit = bytes;
    pc_clock++; /* nothing is in use between calls */
    prefix_make_room(0);
    pthread_mutex_unlock(&pc_lock);
}

int prefix_cache_begin(const int64_t *epochs) {
    if (!epochs) return 0;
    pthread_mutex_lock(&pc_lock);
    if (prefix_limit() > 0) {
        pc_clock++;
        return 1;
    }
    pthread_mutex_unlock(&pc_lock);
    return 0;
}

void prefix_cache_end(void) { pthread_mutex_unlock(&pc_lock); }
