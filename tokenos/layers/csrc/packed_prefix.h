/* The packed-prefix cache of cascade attention (csrc/prefill_attention.c's shared_prefix_decode_bf16).
 *
 * Packed prefixes kept between decode steps. A group's shared pages are the same pages, unchanged,
 * for as long as its members decode, and packing them was most of the cascade's time (31 of its 57
 * samples in a py-spy profile of prefix-64 on an AMX Xeon). The caller passes epochs (int64 per page):
 * epochs[b] takes a value never used before whenever page b may be rewritten (the worker does so when
 * it hands b to a request), so an entry is reused only while each of its pages still has the epoch
 * it was packed at, and an entry of a freed cache can never match a new one at the same address.
 * Entries are bounded by TOKENOS_CASCADE_CACHE_MB (default 256; 0: off): whenever room is made, those
 * unused for PREFIX_STALE_CALLS calls go first, then the least recently used. An entry whose first page
 * has moved to a newer epoch can never match again and goes at the next lookup of a group starting on
 * that page. One lock: calls come from one engine thread, but ctypes lets Python threads call in at
 * once.
 *
 * The kernel brackets its lookups with prefix_cache_begin / prefix_cache_end and packs into the
 * entries it is given: each KV head's tiles at cap_tiles apart, K then V. */
#ifndef TOKENOS_PACKED_PREFIX_H
#define TOKENOS_PACKED_PREFIX_H

#include <stdint.h>

#define PREFIX_TILE_KEYS 32 /* keys per packed tile: prefill_attention.c's PF_KT */

typedef struct {
    const void *cache;
    int64_t page_stride;
    int block_size, num_kv_heads, d, tokens, npages, cap_pages;
    int64_t cap_tiles; /* room per KV head, so a prefix that grows by a page is packed in place */
    int64_t *epochs;   /* [cap_pages], then pages int32 [cap_pages] in the same allocation */
    int32_t *pages;
    uint32_t *kv; /* K then V: [num_kv_heads][cap_tiles][tile_elems] each */
    int64_t bytes;
    uint64_t used;
} prefix_entry;

static inline int64_t prefix_entry_elems(const prefix_entry *e, int64_t tile_elems) {
    return e->cap_tiles * e->num_kv_heads * tile_elems;
}

/* Takes the cache for one kernel call when epochs are given and the cache is on (1), else holds
 * nothing (0); a 1 must be followed by prefix_cache_end. */
int prefix_cache_begin(const int64_t *epochs);
void prefix_cache_end(void);

/* The entry for a group over `tokens` tokens (whole pages) of `pages`, inside begin / end: found whole
 * (*from = its tiles, nothing to pack), grown in place from a shorter one (*from: its whole tiles), or,
 * where `create`, new (*from = 0). NULL: no room, or no entry to find and none to create. */
prefix_entry *prefix_entry_for(const void *cache, int64_t page_stride, int block_size, int num_kv_heads, int d,
                               int tokens, const int32_t *pages, const int64_t *epochs, int64_t tile_elems,
                               int create, int64_t *from);

#endif
