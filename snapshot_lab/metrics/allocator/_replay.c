/*
 * The caching-allocator model of model.py (CachingAllocatorModel, and fit's TopDownAllocator),
 * compiled: a whole stream of operations replayed in C.
 *
 * This file follows model.py line for line; model.py is the reference, and every rule here is
 * there, with its explanation. Blocks live in an arena and are named by their index; a pool is
 * a sorted list of block indexes in chunks (by stream, size, address for free mapped blocks; by
 * stream, address for unmapped ones), searched by bisection like the Python lists of tuples.
 *
 * Inputs come from untrusted files: every size, address and count is range-checked, and every
 * arithmetic step that could overflow is checked. Anything outside what this engine reproduces
 * exactly (a value out of range, a state where the Python model itself would misbehave, such as
 * two free blocks with one key) raises `Unsupported`; the caller then replays in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIN_BLOCK 512LL
#define SMALL_SIZE (1LL << 20)
#define SMALL_BUFFER (2LL << 20)
#define MIN_LARGE_ALLOC (10LL << 20)
#define LARGE_BUFFER (20LL << 20)
#define ROUND_LARGE (2LL << 20)
#define SYNTHETIC_BASE (1LL << 40) /* model.py: self._next_addr = 1 << 40 */
#define TOP_DOWN_TOP (1LL << 47)   /* TopDownAllocator.TOP */
#define EXPANDABLE_SPAN (1LL << 47)
#define MAX_SIZE (1LL << 50)    /* larger requests: replayed in Python */
#define MAX_ADDRESS (1LL << 61) /* larger |addresses|: replayed in Python */

/* operation kinds (native.py names them) */
enum {
    OP_ALLOC = 0,          /* plan semantics: malloc, then free the key's previous block */
    OP_FREE = 1,           /* pop the key's block and free it */
    OP_EMPTY_CACHE = 2,    /* release_cached_blocks */
    OP_FREE_REQUESTED = 3, /* plan: no longer counted, block still held */
    OP_ALLOC_KEEP = 4,     /* what-if: malloc, the key's previous block (if any) stays allocated */
    OP_RECORD_ADDRESS = 5, /* a recorded new segment: size, key = its address */
    OP_OOM_PROBE = 6,      /* the recorded OOM's request: malloc, block kept, never freed */
    OP_NOP = 7,
    OP_RELEASE_UNLESS_SERVED = 8, /* empty_cache unless needs_release(size, stream) */
    OP_ALLOC_IF_ABSENT = 9,       /* malloc only when the key holds no block */
    OP_TRY = 10,                  /* a refused request the run went on from: malloc, freed at once; refused: no OOM */
};

static PyObject *Unsupported;

/* ------------------------------------------------------------------------- blocks */

typedef struct {
    int64_t addr, size, stream;
    int64_t gc_base;
    int64_t key_size, key_addr; /* the key it was inserted into its pool with */
    uint64_t serial;            /* which block this is, over slot reuse */
    int32_t prev, next;         /* -1: none */
    int32_t segment;
    uint8_t small, allocated, mapped, in_pool; /* in_pool: 0 none, 1 mapped pool, 2 unmapped */
} Block;

typedef struct {
    int64_t stream, size, addr; /* size 0 in the unmapped pools */
    int32_t idx;                /* the block */
} Key;

/* a pool's keys in order, each with its block's index (searched without touching the blocks): a
 * list of sorted chunks of at most CHUNK keys, so that an insert or a removal moves the keys of
 * one chunk, not of the whole pool (a recording of a leak holds tens of thousands of free
 * blocks); a pool that fits in one chunk is one sorted array */
#define CHUNK 128
typedef struct {
    Key *key;
    Py_ssize_t len;
} Chunk;

typedef struct {
    Chunk *chunk;
    Py_ssize_t nchunks, cap, len; /* len: keys in all */
    Key *spare;                   /* an emptied chunk's keys, kept for the next one */
} Keys;

typedef struct {
    Py_ssize_t c, o; /* chunk, offset; c == nchunks: the end */
} Pos;

typedef struct {
    int small;
    Keys keys;     /* free mapped blocks by (stream, size, address) */
    Keys unmapped; /* unmapped blocks by (stream, address) */
    int64_t gc_calls;
} Pool;

/* ------------------------------------------------------------------------- hash table */

typedef struct {
    int64_t key;
    int64_t value;          /* block index (-1: none), a queue index, or a block serial */
    uint8_t state;          /* 0 empty, 1 used, 2 deleted */
    uint8_t pending;
} Entry;

typedef struct {
    Entry *e;
    size_t cap, used, filled; /* filled: used + deleted */
} Table;

static uint64_t hash64(int64_t k) {
    uint64_t x = (uint64_t)k + 0x9E3779B97F4A7C15ULL; /* splitmix64 */
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static Entry *table_find(Table *t, int64_t key) {
    if (t->cap == 0) return NULL;
    size_t mask = t->cap - 1, i = hash64(key) & mask;
    for (;;) {
        Entry *e = &t->e[i];
        if (e->state == 0) return NULL;
        if (e->state == 1 && e->key == key) return e;
        i = (i + 1) & mask;
    }
}

static int table_grow(Table *t) {
    size_t cap = t->cap ? t->cap : 64;
    while (cap < 4 * (t->used + 1)) {
        if (cap > ((size_t)1 << 40)) { PyErr_NoMemory(); return -1; }
        cap *= 2;
    }
    Entry *fresh = PyMem_Calloc(cap, sizeof(Entry));
    if (!fresh) { PyErr_NoMemory(); return -1; }
    for (size_t j = 0; j < t->cap; j++) {
        if (t->e[j].state != 1) continue;
        size_t i = hash64(t->e[j].key) & (cap - 1);
        while (fresh[i].state) i = (i + 1) & (cap - 1);
        fresh[i] = t->e[j];
    }
    PyMem_Free(t->e);
    t->e = fresh;
    t->cap = cap;
    t->filled = t->used;
    return 0;
}

/* the entry for key, made (value -1) when missing; NULL with an exception on failure */
static Entry *table_get_or_add(Table *t, int64_t key) {
    Entry *found = table_find(t, key);
    if (found) return found;
    if (2 * (t->filled + 1) > t->cap && table_grow(t) < 0) return NULL;
    size_t mask = t->cap - 1, i = hash64(key) & mask;
    while (t->e[i].state == 1) i = (i + 1) & mask;
    Entry *e = &t->e[i];
    if (e->state == 0) t->filled++;
    e->state = 1;
    e->key = key;
    e->value = -1;
    e->pending = 0;
    t->used++;
    return e;
}

static void table_delete(Table *t, Entry *e) {
    e->state = 2;
    t->used--;
}

/* ------------------------------------------------------------------------- the engine */

typedef struct {
    int64_t *data;
    Py_ssize_t head, len, cap;
} Queue;

typedef struct {
    int64_t start, length;
} Range;

typedef struct {
    PyObject_HEAD
    /* settings */
    int64_t max_split_size; /* INT64_MAX: unlimited */
    int ms_unlimited;
    int64_t max_non_split_rounding;
    int64_t divisions[16];
    double gc_threshold;
    int expandable;
    int has_limit;
    int64_t limit;
    int gc; /* garbage collection runs: a cap and a threshold */
    int top_down;
    /* state */
    Block *blocks;
    Py_ssize_t nblocks, blocks_cap;
    int32_t *free_slots;
    Py_ssize_t nfree_slots, free_slots_cap;
    uint64_t next_serial;
    Pool small, large;
    Table live;           /* key -> block (+ pending flag) */
    Table placed;         /* key -> serial of the block it held at mark_placed() */
    Table segment_starts; /* cudaMalloc'd segment addresses alive */
    Table recorded;       /* size -> index into queues */
    Queue *queues;
    Py_ssize_t nqueues, queues_cap;
    Range *free_va;
    Py_ssize_t nfree_va, free_va_cap;
    int64_t next_addr;
    int64_t next_segment;
    int64_t *seg_base; /* per segment id: expandable range start */
    uint8_t *seg_exp;  /* per segment id: an expandable range */
    Py_ssize_t seg_cap;
    /* stats */
    int64_t reserved, peak_reserved, allocated, peak_allocated;
    int64_t malloc_calls, free_calls, retries;
    int64_t *ooms; /* pairs (event index, size) */
    Py_ssize_t nooms, ooms_cap;
    int64_t level; /* the plan's allocated bytes (pending frees not counted) */
} Engine;

static int unsupported(const char *what) {
    PyErr_SetString(Unsupported, what);
    return -1;
}

/* grow a dynamic array to hold n items */
static int reserve_items(void **data, Py_ssize_t *cap, Py_ssize_t n, size_t item) {
    if (n <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 16;
    while (c < n) {
        if (c > PY_SSIZE_T_MAX / 4 / (Py_ssize_t)item) { PyErr_NoMemory(); return -1; }
        c *= 2;
    }
    void *p = PyMem_Realloc(*data, (size_t)c * item);
    if (!p) { PyErr_NoMemory(); return -1; }
    *data = p;
    *cap = c;
    return 0;
}

static int add_checked(int64_t a, int64_t b, int64_t *out) {
    if (__builtin_add_overflow(a, b, out)) return unsupported("a sum of sizes is out of range");
    return 0;
}

static int sub_checked(int64_t a, int64_t b, int64_t *out) {
    if (__builtin_sub_overflow(a, b, out)) return unsupported("a difference of sizes is out of range");
    return 0;
}

static int32_t new_block(Engine *m, int64_t addr, int64_t size, int64_t stream, int small, int64_t segment) {
    int32_t i;
    if (m->nfree_slots) {
        i = m->free_slots[--m->nfree_slots];
    } else {
        if (m->nblocks >= INT32_MAX) { unsupported("too many blocks"); return -1; }
        if (reserve_items((void **)&m->blocks, &m->blocks_cap, m->nblocks + 1, sizeof(Block)) < 0) return -1;
        i = (int32_t)m->nblocks++;
    }
    Block *b = &m->blocks[i];
    memset(b, 0, sizeof *b);
    b->addr = addr;
    b->size = size;
    b->stream = stream;
    b->small = (uint8_t)small;
    b->segment = (int32_t)segment;
    b->prev = b->next = -1;
    b->mapped = 1;
    b->serial = ++m->next_serial;
    return i;
}

static int drop_block(Engine *m, int32_t i) {
    if (reserve_items((void **)&m->free_slots, &m->free_slots_cap, m->nfree_slots + 1, sizeof(int32_t)) < 0)
        return -1;
    m->blocks[i].serial = 0;
    m->free_slots[m->nfree_slots++] = i;
    return 0;
}

static int64_t new_segment_id(Engine *m, int expandable, int64_t base) {
    int64_t id = m->next_segment;
    if (id >= INT32_MAX) { unsupported("too many segments"); return -1; }
    if (id >= m->seg_cap) {
        Py_ssize_t cap = m->seg_cap;
        if (reserve_items((void **)&m->seg_base, &cap, id + 1, sizeof(int64_t)) < 0) return -1;
        cap = m->seg_cap;
        if (reserve_items((void **)&m->seg_exp, &cap, id + 1, sizeof(uint8_t)) < 0) return -1;
        m->seg_cap = cap;
    }
    m->seg_base[id] = base;
    m->seg_exp[id] = (uint8_t)expandable;
    m->next_segment++;
    return id;
}

#define BLK(i) (&m->blocks[(i)])
#define IS_EXP(b) (m->seg_exp[(b)->segment])
#define IS_SPLIT(b) ((b)->prev >= 0 || (b)->next >= 0)

/* ------------------------------------------------------------------------- pools */

static int cmp_key(const Key *k, int64_t stream, int64_t size, int64_t addr) {
    if (k->stream != stream) return k->stream < stream ? -1 : 1;
    if (k->size != size) return k->size < size ? -1 : 1;
    if (k->addr != addr) return k->addr < addr ? -1 : 1;
    return 0;
}

#define AT_END(t, pos) ((pos).c >= (t)->nchunks)
#define KEY(t, pos) (&(t)->chunk[(pos).c].key[(pos).o])
/* every place of t in order (t unchanged on the way) */
#define FOR_EACH_KEY(t, pos) for (Pos pos = {0, 0}; !AT_END(t, pos); pos_next(t, &pos))

/* bisect_left(keys, (stream, size, addr)): the first chunk whose last key is not below it, then
 * the place in that chunk */
static inline Pos keys_find(const Keys *t, int64_t stream, int64_t size, int64_t addr) {
    Py_ssize_t lo = 0, hi = t->nchunks - 1; /* the last chunk holds any key above the others */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        const Chunk *ch = &t->chunk[mid];
        if (cmp_key(&ch->key[ch->len - 1], stream, size, addr) < 0) lo = mid + 1;
        else hi = mid;
    }
    Pos pos = {lo, 0};
    if (t->nchunks == 0) return pos;
    const Chunk *ch = &t->chunk[lo];
    Py_ssize_t a = 0, b = ch->len;
    while (a < b) {
        Py_ssize_t mid = a + (b - a) / 2;
        if (cmp_key(&ch->key[mid], stream, size, addr) < 0) a = mid + 1;
        else b = mid;
    }
    if (a == ch->len) { /* above every key */
        pos.c = t->nchunks;
        a = 0;
    }
    pos.o = a;
    return pos;
}

static void pos_next(const Keys *t, Pos *pos) {
    if (++pos->o == t->chunk[pos->c].len) {
        pos->c++;
        pos->o = 0;
    }
}

/* the place before *pos (from the end: the last key); 0 when there is none */
static int pos_prev(const Keys *t, Pos *pos) {
    if (pos->o > 0) {
        pos->o--;
        return 1;
    }
    if (pos->c == 0) return 0;
    pos->c--;
    pos->o = t->chunk[pos->c].len - 1;
    return 1;
}

/* a new, empty chunk at index c */
static int add_chunk(Keys *t, Py_ssize_t c) {
    Key *key = t->spare ? t->spare : PyMem_Malloc(CHUNK * sizeof(Key));
    t->spare = NULL;
    if (!key || reserve_items((void **)&t->chunk, &t->cap, t->nchunks + 1, sizeof(Chunk)) < 0) {
        PyMem_Free(key);
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    memmove(t->chunk + c + 1, t->chunk + c, (size_t)(t->nchunks - c) * sizeof(Chunk));
    t->chunk[c].key = key;
    t->chunk[c].len = 0;
    t->nchunks++;
    return 0;
}

static void set_key(Key *k, int64_t stream, int64_t size, int64_t addr, int32_t idx) {
    k->stream = stream;
    k->size = size;
    k->addr = addr;
    k->idx = idx;
}

/* insort: 1 when the key is there already (nothing changed), -1 on error */
static int keys_insert(Keys *t, int64_t stream, int64_t size, int64_t addr, int32_t idx) {
    Pos pos = keys_find(t, stream, size, addr);
    if (!AT_END(t, pos) && cmp_key(KEY(t, pos), stream, size, addr) == 0) return 1;
    if (t->nchunks == 0 && add_chunk(t, 0) < 0) return -1;
    if (AT_END(t, pos)) {
        pos.c = t->nchunks - 1;
        pos.o = t->chunk[pos.c].len;
    }
    if (t->chunk[pos.c].len == CHUNK) { /* a full chunk: its upper half becomes the next one */
        if (add_chunk(t, pos.c + 1) < 0) return -1;
        Chunk *full = &t->chunk[pos.c], *upper = &t->chunk[pos.c + 1];
        memcpy(upper->key, full->key + CHUNK / 2, (CHUNK - CHUNK / 2) * sizeof(Key));
        upper->len = CHUNK - CHUNK / 2;
        full->len = CHUNK / 2;
        if (pos.o > CHUNK / 2) {
            pos.c++;
            pos.o -= CHUNK / 2;
        }
    }
    Chunk *ch = &t->chunk[pos.c];
    memmove(ch->key + pos.o + 1, ch->key + pos.o, (size_t)(ch->len - pos.o) * sizeof(Key));
    set_key(&ch->key[pos.o], stream, size, addr, idx);
    ch->len++;
    t->len++;
    return 0;
}

/* del keys[pos]: the places before it stay where they are */
static void keys_erase(Keys *t, Pos pos) {
    Chunk *ch = &t->chunk[pos.c];
    memmove(ch->key + pos.o, ch->key + pos.o + 1, (size_t)(ch->len - pos.o - 1) * sizeof(Key));
    ch->len--;
    t->len--;
    if (ch->len == 0) {
        if (t->spare) PyMem_Free(ch->key);
        else t->spare = ch->key;
        memmove(t->chunk + pos.c, t->chunk + pos.c + 1, (size_t)(t->nchunks - pos.c - 1) * sizeof(Chunk));
        t->nchunks--;
    }
}

static Pool *pool_of(Engine *m, int small) { return small ? &m->small : &m->large; }

#define SAME_KEY "two free blocks with the same (stream, size, address)"

/* block b is in pool p's keys now, under its current size and address */
static void entered_pool(Block *b, Pool *p) {
    b->key_size = b->size;
    b->key_addr = b->addr;
    b->in_pool = 1;
    b->gc_base = p->gc_calls;
}

/* _Pool.insert */
static int pool_insert(Engine *m, Pool *p, int32_t i) {
    Block *b = BLK(i);
    int rc = keys_insert(&p->keys, b->stream, b->size, b->addr, i);
    if (rc < 0) return -1;
    if (rc) return unsupported(SAME_KEY);
    entered_pool(b, p);
    return 0;
}

/* _Pool.remove (by the key it was inserted with) */
static int pool_remove(Engine *m, Pool *p, int32_t i) {
    Block *b = BLK(i);
    Pos pos = keys_find(&p->keys, b->stream, b->key_size, b->key_addr);
    if (b->in_pool != 1 || AT_END(&p->keys, pos) || KEY(&p->keys, pos)->idx != i)
        return unsupported("a block removed from a pool it is not in");
    keys_erase(&p->keys, pos);
    b->in_pool = 0;
    return 0;
}

/* the block at place `at` leaves the pool and block i enters it: pool.remove then pool.insert, in
 * one move of the keys between the two places when both are in at's chunk. `below`: i's key sorts
 * below the leaving one (a split's rest), else above (a block merged with the neighbour at `at`) */
static int pool_replace(Engine *m, Pool *p, Pos at, int32_t i, int below) {
    Block *b = BLK(i);
    Keys *t = &p->keys;
    Chunk *ch = &t->chunk[at.c];
    /* bisect_left in at's chunk, on the side of `at` where the key goes */
    Py_ssize_t lo = below ? 0 : at.o + 1, hi = below ? at.o : ch->len;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (cmp_key(&ch->key[mid], b->stream, b->size, b->addr) < 0) lo = mid + 1;
        else hi = mid;
    }
    int here; /* the place is in this chunk: not at its edge, or no neighbour chunk holds it */
    if (below) {
        const Chunk *prev = at.c > 0 ? &t->chunk[at.c - 1] : NULL;
        here = lo > 0 || !prev || cmp_key(&prev->key[prev->len - 1], b->stream, b->size, b->addr) < 0;
    } else {
        const Chunk *next = at.c + 1 < t->nchunks ? &t->chunk[at.c + 1] : NULL;
        here = lo < ch->len || !next || cmp_key(&next->key[0], b->stream, b->size, b->addr) > 0;
    }
    if (here && lo < ch->len && lo != at.o && cmp_key(&ch->key[lo], b->stream, b->size, b->addr) == 0)
        return unsupported(SAME_KEY);
    if (!here) {
        keys_erase(t, at);
        int rc = keys_insert(t, b->stream, b->size, b->addr, i);
        if (rc < 0) return -1;
        if (rc) return unsupported(SAME_KEY);
    } else if (below) {
        memmove(ch->key + lo + 1, ch->key + lo, (size_t)(at.o - lo) * sizeof(Key));
        set_key(&ch->key[lo], b->stream, b->size, b->addr, i);
    } else {
        memmove(ch->key + at.o, ch->key + at.o + 1, (size_t)(lo - 1 - at.o) * sizeof(Key));
        set_key(&ch->key[lo - 1], b->stream, b->size, b->addr, i);
    }
    entered_pool(b, p);
    return 0;
}

static int insert_unmapped(Engine *m, Pool *p, int32_t i) {
    Block *b = BLK(i);
    b->key_addr = b->addr;
    int rc = keys_insert(&p->unmapped, b->stream, 0, b->addr, i);
    if (rc < 0) return -1;
    if (rc) return unsupported("two unmapped blocks at one address");
    b->in_pool = 2;
    return 0;
}

static int remove_unmapped(Engine *m, Pool *p, int32_t i) {
    Block *b = BLK(i);
    Pos pos = keys_find(&p->unmapped, b->stream, 0, b->addr);
    if (b->in_pool != 2 || b->key_addr != b->addr || AT_END(&p->unmapped, pos) || KEY(&p->unmapped, pos)->idx != i)
        return unsupported("an unmapped block removed from a pool it is not in");
    keys_erase(&p->unmapped, pos);
    b->in_pool = 0;
    return 0;
}

/* ------------------------------------------------------------------------- sizes */

static int log2_floor(int64_t x) { return 63 - __builtin_clzll((uint64_t)x); }

/* round_size; sizes are checked to lie in [MIN_BLOCK, MAX_SIZE] or below MIN_BLOCK */
static int64_t round_size(Engine *m, int64_t size) {
    if (size < MIN_BLOCK) return MIN_BLOCK;
    int log_size = log2_floor(size);
    int index = log_size - 20 > 0 ? log_size - 20 : 0;
    if (index > 15) index = 15;
    int64_t divisions = m->divisions[index];
    if (divisions > 1 && size > MIN_BLOCK * divisions) {
        if ((size & (size - 1)) == 0) return size;
        int64_t floor = (int64_t)1 << log_size;
        int64_t step = floor >> log2_floor(divisions);
        if (step == 0) return floor << 1;
        int64_t r = size & ~(step - 1);
        return r == size ? size : r + step;
    }
    return (size + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

static int64_t allocation_size(int64_t size) {
    if (size <= SMALL_SIZE) return SMALL_BUFFER;
    if (size < MIN_LARGE_ALLOC) return LARGE_BUFFER;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

static int64_t address_space(int64_t size) { return (size + (2LL << 20) - 1) / (2LL << 20) * (2LL << 20); }

/* ------------------------------------------------------------------------- reserve and addresses */

static int reserve_bytes(Engine *m, int64_t n, int *ok) {
    int64_t total;
    if (add_checked(m->reserved, n, &total) < 0) return -1;
    if (m->has_limit && total > m->limit) {
        *ok = 0;
        return 0;
    }
    m->reserved = total;
    if (total > m->peak_reserved) m->peak_reserved = total;
    *ok = 1;
    return 0;
}

/* _take_freed_range: the lowest freed range that holds need (first fit in (start, length) order) */
static int take_freed_range(Engine *m, int64_t need, int64_t *addr) {
    for (Py_ssize_t i = 0; i < m->nfree_va; i++) {
        Range *r = &m->free_va[i];
        if (r->length >= need) {
            *addr = r->start;
            if (r->length == need) {
                memmove(r, r + 1, (size_t)(m->nfree_va - i - 1) * sizeof(Range));
                m->nfree_va--;
            } else {
                r->start += need;
                r->length -= need;
            }
            return 1;
        }
    }
    return 0;
}

static int fresh_range(Engine *m, int64_t need, int64_t *addr) {
    if (m->top_down) {
        int64_t top = m->next_addr < TOP_DOWN_TOP ? m->next_addr : TOP_DOWN_TOP;
        if (__builtin_sub_overflow(top, need, &m->next_addr) || m->next_addr < -MAX_ADDRESS)
            return unsupported("address space exhausted");
        *addr = m->next_addr;
    } else {
        *addr = m->next_addr;
        if (add_checked(m->next_addr, need, &m->next_addr) < 0 || m->next_addr > MAX_ADDRESS)
            return unsupported("address space exhausted");
    }
    return 0;
}

/* _new_address */
static int new_address(Engine *m, int64_t size, int64_t *addr) {
    Entry *e = table_find(&m->recorded, size);
    if (e) {
        Queue *q = &m->queues[e->value];
        while (q->len) {
            int64_t a = q->data[q->head++];
            q->len--;
            if (!table_find(&m->segment_starts, a)) {
                *addr = a;
                return 0;
            }
        }
    }
    int64_t need = address_space(size);
    if (take_freed_range(m, need, addr)) return 0;
    return fresh_range(m, need, addr);
}

/* insort(self._free_va, (addr, length)): after every equal pair */
static int insort_range(Engine *m, int64_t start, int64_t length) {
    Py_ssize_t lo = 0, hi = m->nfree_va;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        Range *r = &m->free_va[mid];
        if (start < r->start || (start == r->start && length < r->length)) hi = mid;
        else lo = mid + 1;
    }
    if (reserve_items((void **)&m->free_va, &m->free_va_cap, m->nfree_va + 1, sizeof(Range)) < 0) return -1;
    memmove(m->free_va + lo + 1, m->free_va + lo, (size_t)(m->nfree_va - lo) * sizeof(Range));
    m->free_va[lo].start = start;
    m->free_va[lo].length = length;
    m->nfree_va++;
    return 0;
}

static int return_address(Engine *m, int64_t addr, int64_t size) {
    if (!m->top_down && !(addr >= SYNTHETIC_BASE && addr < m->next_addr)) return 0;
    return insort_range(m, addr, address_space(size));
}

static int record_address(Engine *m, int64_t size, int64_t addr) {
    Entry *e = table_get_or_add(&m->recorded, size);
    if (!e) return -1;
    if (e->value < 0) {
        if (reserve_items((void **)&m->queues, &m->queues_cap, m->nqueues + 1, sizeof(Queue)) < 0) return -1;
        memset(&m->queues[m->nqueues], 0, sizeof(Queue));
        e->value = m->nqueues++;
    }
    Queue *q = &m->queues[e->value];
    if (q->head && q->head + q->len == q->cap) { /* compact before growing */
        memmove(q->data, q->data + q->head, (size_t)q->len * sizeof(int64_t));
        q->head = 0;
    }
    if (reserve_items((void **)&q->data, &q->cap, q->head + q->len + 1, sizeof(int64_t)) < 0) return -1;
    q->data[q->head + q->len++] = addr;
    return 0;
}

/* ------------------------------------------------------------------------- split, merge, release */

/* _split_after: keep the first n bytes in b; returns the rest, linked after it (-1: error) */
static int32_t split_after(Engine *m, int32_t bi, int64_t n) {
    Block *b = BLK(bi);
    int32_t ri = new_block(m, b->addr + n, b->size - n, b->stream, b->small, b->segment);
    if (ri < 0) return -1;
    b = BLK(bi); /* the arena may have moved */
    Block *rest = BLK(ri);
    rest->mapped = b->mapped;
    rest->prev = bi;
    rest->next = b->next;
    if (b->next >= 0) BLK(b->next)->prev = ri;
    b->next = ri;
    b->size = n;
    return ri;
}

/* _try_merge(dst, src): src joins dst when both are free and equally mapped */
static int join_blocks(Engine *m, int32_t di, int32_t si);

static int try_merge(Engine *m, int32_t di, int32_t si, Pool *p) {
    if (si < 0) return 0;
    Block *d = BLK(di), *s = BLK(si);
    if (s->allocated || d->mapped != s->mapped) return 0;
    if ((s->mapped ? pool_remove(m, p, si) : remove_unmapped(m, p, si)) < 0) return -1;
    return join_blocks(m, di, si);
}

/* free_block's merges: try_merge, where the mapped neighbour's place among the pool's keys is
 * left for the freed block (*hole, *holed; a place left by the neighbour before is taken out
 * first) */
static int merge_into_freed(Engine *m, int32_t di, int32_t si, Pool *p, Pos *hole, int *holed) {
    if (si < 0) return 0;
    Block *d = BLK(di), *s = BLK(si);
    if (s->allocated || d->mapped != s->mapped) return 0;
    if (!s->mapped) return try_merge(m, di, si, p);
    if (*holed) {
        keys_erase(&p->keys, *hole);
        *holed = 0;
    }
    Pos pos = keys_find(&p->keys, s->stream, s->key_size, s->key_addr);
    if (s->in_pool != 1 || AT_END(&p->keys, pos) || KEY(&p->keys, pos)->idx != si)
        return unsupported("a block removed from a pool it is not in");
    s->in_pool = 0;
    *hole = pos;
    *holed = 1;
    return join_blocks(m, di, si);
}

/* src joins dst (both free, equally mapped, src out of its pool) */
static int join_blocks(Engine *m, int32_t di, int32_t si) {
    Block *d = BLK(di), *s = BLK(si);
    if (d->prev == si) {
        d->addr = s->addr;
        d->prev = s->prev;
        if (d->prev >= 0) BLK(d->prev)->next = di;
    } else {
        d->next = s->next;
        if (d->next >= 0) BLK(d->next)->prev = di;
    }
    d->size += s->size;
    return drop_block(m, si);
}

static void table_discard(Table *t, int64_t key) {
    Entry *e = table_find(t, key);
    if (e) table_delete(t, e);
}

/* _release_block */
static int release_block(Engine *m, int32_t bi, Pool *p) {
    Block *b = BLK(bi);
    if (IS_SPLIT(b)) return unsupported("a split block released to the driver");
    if (pool_remove(m, p, bi) < 0) return -1;
    table_discard(&m->segment_starts, b->addr);
    m->reserved -= b->size;
    if (return_address(m, b->addr, b->size) < 0) return -1;
    m->free_calls++;
    return drop_block(m, bi);
}

/* _unmap_block */
static int unmap_block(Engine *m, int32_t bi, Pool *p) {
    Block *b = BLK(bi);
    int64_t page = p->small ? SMALL_BUFFER : LARGE_BUFFER;
    int64_t base = m->seg_base[b->segment];
    int64_t start = base + (b->addr - base + page - 1) / page * page;
    int64_t end = base + (b->addr + b->size - base) / page * page;
    if (end <= start) return 0;
    if (pool_remove(m, p, bi) < 0) return -1;
    if (end < b->addr + b->size) {
        int32_t ri = split_after(m, bi, end - BLK(bi)->addr);
        if (ri < 0 || pool_insert(m, p, ri) < 0) return -1;
    }
    if (start > BLK(bi)->addr) {
        int32_t before = bi;
        bi = split_after(m, bi, start - BLK(bi)->addr);
        if (bi < 0 || pool_insert(m, p, before) < 0) return -1;
    }
    BLK(bi)->mapped = 0;
    if (try_merge(m, bi, BLK(bi)->prev, p) < 0) return -1;
    if (try_merge(m, bi, BLK(bi)->next, p) < 0) return -1;
    if (insert_unmapped(m, p, bi) < 0) return -1;
    m->reserved -= end - start;
    m->free_calls++;
    return 0;
}

/* a pool's blocks in key order, to walk while the pool changes */
static int32_t *snapshot(const Keys *t) {
    int32_t *copy = PyMem_Malloc((size_t)(t->len ? t->len : 1) * sizeof(int32_t));
    if (!copy) { PyErr_NoMemory(); return NULL; }
    Py_ssize_t j = 0;
    FOR_EACH_KEY(t, pos) copy[j++] = KEY(t, pos)->idx;
    return copy;
}

/* whether block index i still holds the block of the given serial, free in pool p */
static int still_in_pool(Engine *m, int32_t i, uint64_t serial) {
    return BLK(i)->serial == serial && BLK(i)->in_pool == 1;
}

/* empty_cache: release_cached_blocks */
static int empty_cache(Engine *m) {
    Pool *pools[2] = {&m->large, &m->small};
    for (int k = 0; k < 2; k++) {
        Pool *p = pools[k];
        Py_ssize_t n = p->keys.len;
        int32_t *keys = snapshot(&p->keys);
        uint64_t *serials = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
        int32_t *to_unmap = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));
        uint64_t *unmap_serials = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
        int rc = 0;
        Py_ssize_t nunmap = 0;
        if (!keys || !serials || !to_unmap || !unmap_serials) { PyErr_NoMemory(); rc = -1; }
        for (Py_ssize_t j = 0; rc == 0 && j < n; j++) serials[j] = BLK(keys[j])->serial;
        for (Py_ssize_t j = 0; rc == 0 && j < n; j++) {
            if (!still_in_pool(m, keys[j], serials[j])) continue;
            Block *b = BLK(keys[j]);
            if (IS_EXP(b)) {
                to_unmap[nunmap] = keys[j];
                unmap_serials[nunmap++] = serials[j];
            } else if (!IS_SPLIT(b)) {
                rc = release_block(m, keys[j], p);
            }
        }
        for (Py_ssize_t j = 0; rc == 0 && j < nunmap; j++) {
            /* model.py unmaps every block it listed; each is still the free block it was */
            if (BLK(to_unmap[j])->serial != unmap_serials[j] || BLK(to_unmap[j])->in_pool != 1)
                rc = unsupported("a block to unmap changed before its turn");
            else
                rc = unmap_block(m, to_unmap[j], p);
        }
        PyMem_Free(keys);
        PyMem_Free(serials);
        PyMem_Free(to_unmap);
        PyMem_Free(unmap_serials);
        if (rc < 0) return -1;
    }
    return 0;
}

/* _garbage_collect */
static int garbage_collect(Engine *m) {
    int64_t threshold = (int64_t)(m->gc_threshold * (double)m->limit);
    if (m->reserved <= threshold) return 0;
    int64_t target = m->reserved - threshold;
    Pool *p = &m->large;
    int64_t total_age = 0, count = 0;
    FOR_EACH_KEY(&p->keys, pos) {
        Block *b = BLK(KEY(&p->keys, pos)->idx);
        if (!IS_SPLIT(b)) {
            if (add_checked(total_age, p->gc_calls - b->gc_base, &total_age) < 0) return -1;
            count++;
        }
    }
    if (!count) return 0;
    /* the Python model divides exactly-held integers: doubles match it below 2**53 */
    if (total_age > (1LL << 52)) return unsupported("garbage collection ages out of range");
    int64_t reclaimed = 0;
    int freed = 1;
    while (reclaimed < target && freed && count > 0) {
        double threshold_age = (double)total_age / (double)count;
        freed = 0;
        Py_ssize_t n = p->keys.len;
        int32_t *keys = snapshot(&p->keys);
        uint64_t *serials = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
        int rc = 0;
        if (!keys || !serials) { PyErr_NoMemory(); rc = -1; }
        for (Py_ssize_t j = 0; rc == 0 && j < n; j++) serials[j] = BLK(keys[j])->serial;
        for (Py_ssize_t j = 0; rc == 0 && j < n; j++) {
            if (!still_in_pool(m, keys[j], serials[j])) continue;
            Block *b = BLK(keys[j]);
            if (IS_SPLIT(b) || IS_EXP(b)) continue;
            int64_t age = p->gc_calls - b->gc_base;
            if ((double)age >= threshold_age) {
                freed = 1;
                reclaimed += b->size;
                total_age -= age;
                count--;
                rc = release_block(m, keys[j], p);
            }
        }
        PyMem_Free(keys);
        PyMem_Free(serials);
        if (rc < 0) return -1;
    }
    return 0;
}

/* _release_available_cached_blocks: 1 when it released enough */
static int release_available_cached_blocks(Engine *m, Pool *p, int64_t size, int64_t stream) {
    if (m->ms_unlimited) return 0;
    int64_t ms = m->max_split_size;
    int64_t want = size > ms ? size : ms;
    Keys *keys = &p->keys;
    Pos at = keys_find(keys, stream, want, -1);
    if (AT_END(keys, at) || BLK(KEY(keys, at)->idx)->stream != stream || IS_EXP(BLK(KEY(keys, at)->idx))) {
        if (!pos_prev(keys, &at)) return 0;
        int64_t released = 0;
        for (int more = 1; released < want && more;) {
            int32_t bi = KEY(keys, at)->idx;
            Block *b = BLK(bi);
            if (b->size < ms || b->stream != stream) break;
            more = pos_prev(keys, &at); /* the places below bi's stay where they are when it leaves */
            if (!IS_EXP(b)) {
                int64_t n = b->size;
                if (release_block(m, bi, p) < 0) return -1;
                released += n;
            }
        }
        return released >= want;
    }
    if (release_block(m, KEY(keys, at)->idx, p) < 0) return -1;
    return 1;
}

/* ------------------------------------------------------------------------- expandable segments */

static int map_block(Engine *m, Pool *p, int32_t bi, int64_t size, int64_t page, int *ok) {
    int64_t n = (size + page - 1) / page * page;
    if (n > BLK(bi)->size) n = BLK(bi)->size;
    if (reserve_bytes(m, n, ok) < 0) return -1;
    if (!*ok) return 0;
    m->malloc_calls++;
    if (remove_unmapped(m, p, bi) < 0) return -1;
    if (n < BLK(bi)->size) {
        int32_t ri = split_after(m, bi, n);
        if (ri < 0 || insert_unmapped(m, p, ri) < 0) return -1;
    }
    BLK(bi)->mapped = 1;
    if (try_merge(m, bi, BLK(bi)->prev, p) < 0) return -1;
    if (try_merge(m, bi, BLK(bi)->next, p) < 0) return -1;
    return pool_insert(m, p, bi);
}

static int allocatable(Engine *m, int32_t i) { return i >= 0 && !BLK(i)->allocated; }

/* _find_expandable_block (-1: error) */
static int32_t find_expandable_block(Engine *m, Pool *p, int64_t size, int64_t stream) {
    Keys *u = &p->unmapped;
    for (Pos at = keys_find(u, stream, 0, -1); !AT_END(u, at) && KEY(u, at)->stream == stream; pos_next(u, &at)) {
        int32_t c = KEY(u, at)->idx;
        if (allocatable(m, BLK(c)->prev)) c = BLK(c)->prev;
        int64_t have = 0;
        int32_t cur = c;
        while (have < size && allocatable(m, cur)) {
            have += BLK(cur)->size;
            cur = BLK(cur)->next;
        }
        if (have >= size) return c;
    }
    int64_t seg = new_segment_id(m, 1, 0);
    if (seg < 0) return -1;
    int64_t addr;
    if (new_address(m, EXPANDABLE_SPAN, &addr) < 0) return -1;
    if (addr < -MAX_ADDRESS || addr > MAX_ADDRESS) { unsupported("an address out of range"); return -1; }
    m->seg_base[seg] = addr;
    int32_t fresh = new_block(m, addr, EXPANDABLE_SPAN, stream, p->small, seg);
    if (fresh < 0) return -1;
    BLK(fresh)->mapped = 0;
    if (insert_unmapped(m, p, fresh) < 0) return -1;
    return fresh;
}

/* _try_allocate_expandable: *out -1 when it cannot */
static int try_allocate_expandable(Engine *m, Pool *p, int64_t size, int64_t stream, int32_t *out) {
    int64_t page = p->small ? SMALL_BUFFER : LARGE_BUFFER;
    int ok = 1;
    *out = -1;
    int32_t cand = find_expandable_block(m, p, size, stream);
    if (cand < 0) return -1;
    if (!BLK(cand)->mapped) {
        int64_t n = BLK(cand)->size < size ? BLK(cand)->size : size;
        if (map_block(m, p, cand, n, page, &ok) < 0) return -1;
        if (!ok) return 0;
    }
    while (BLK(cand)->size < size) {
        int32_t nxt = BLK(cand)->next;
        if (nxt < 0 || BLK(nxt)->mapped) return 0;
        int64_t want = size - BLK(cand)->size;
        int64_t n = BLK(nxt)->size < want ? BLK(nxt)->size : want;
        if (map_block(m, p, nxt, n, page, &ok) < 0) return -1;
        if (!ok) return 0;
        cand = nxt;
    }
    if (pool_remove(m, p, cand) < 0) return -1;
    *out = cand;
    return 0;
}

/* ------------------------------------------------------------------------- malloc and free */

/* _alloc_block: *out -1 when cudaMalloc fails */
static int alloc_block(Engine *m, Pool *p, int64_t size, int64_t alloc_size, int64_t stream, int32_t *out) {
    *out = -1;
    if (m->expandable) return try_allocate_expandable(m, p, size, stream, out);
    int ok;
    if (reserve_bytes(m, alloc_size, &ok) < 0) return -1;
    if (!ok) return 0;
    m->malloc_calls++;
    int64_t addr;
    if (new_address(m, alloc_size, &addr) < 0) return -1;
    if (addr < -MAX_ADDRESS || addr > MAX_ADDRESS) return unsupported("an address out of range");
    if (!table_get_or_add(&m->segment_starts, addr)) return -1;
    int64_t seg = new_segment_id(m, 0, 0);
    if (seg < 0) return -1;
    *out = new_block(m, addr, alloc_size, stream, p->small, seg);
    return *out < 0 ? -1 : 0;
}

static int64_t expandable_size(Engine *m, Block *b) {
    return b->size + (b->next >= 0 && !BLK(b->next)->mapped ? BLK(b->next)->size : 0);
}

/* _get_free_block: *out -1 when none serves, else the block, left in the pool at *at (the caller
 * takes it out: engine_malloc) */
static int get_free_block(Engine *m, Pool *p, int64_t size, int64_t stream, int32_t *out, Pos *at) {
    *out = -1;
    if (m->gc) p->gc_calls++;
    Keys *keys = &p->keys;
    *at = keys_find(keys, stream, size, -1);
    if (AT_END(keys, *at) || KEY(keys, *at)->stream != stream) return 0;
    int32_t bi = KEY(keys, *at)->idx;
    if (m->expandable && IS_EXP(BLK(bi))) {
        Pos j = *at;
        for (pos_next(keys, &j); !AT_END(keys, j) && KEY(keys, j)->stream == stream; pos_next(keys, &j)) {
            int32_t ni = KEY(keys, j)->idx;
            if (expandable_size(m, BLK(ni)) >= expandable_size(m, BLK(bi))) break;
            bi = ni;
            *at = j;
        }
    }
    Block *b = BLK(bi);
    if (m->ms_unlimited || size < m->max_split_size) {
        if (!m->ms_unlimited && b->size >= m->max_split_size) return 0;
    } else if (b->size >= size + m->max_non_split_rounding) {
        return 0;
    }
    *out = bi;
    return 0;
}

static int record_oom(Engine *m, int64_t event_index, int64_t size) {
    if (reserve_items((void **)&m->ooms, &m->ooms_cap, 2 * m->nooms + 2, sizeof(int64_t)) < 0) return -1;
    m->ooms[2 * m->nooms] = event_index;
    m->ooms[2 * m->nooms + 1] = size;
    m->nooms++;
    return 0;
}

/* _new_block: 1 on OutOfMemory */
static int new_block_for(Engine *m, Pool *p, int64_t size, int64_t stream, int64_t event_index, int32_t *out) {
    int64_t alloc_size = allocation_size(size);
    if (m->gc && garbage_collect(m) < 0) return -1;
    if (alloc_block(m, p, size, alloc_size, stream, out) < 0) return -1;
    if (*out < 0) {
        int released = release_available_cached_blocks(m, p, size, stream);
        if (released < 0) return -1;
        if (released && alloc_block(m, p, size, alloc_size, stream, out) < 0) return -1;
    }
    if (*out < 0) {
        m->retries++;
        if (empty_cache(m) < 0) return -1;
        if (alloc_block(m, p, size, alloc_size, stream, out) < 0) return -1;
    }
    if (*out < 0) {
        if (record_oom(m, event_index, size) < 0) return -1;
        return 1;
    }
    return 0;
}

static int check_request(int64_t orig_size, int64_t stream) {
    if (orig_size > MAX_SIZE) return unsupported("a request larger than 1 PiB");
    if (stream < -MAX_ADDRESS || stream > MAX_ADDRESS) return unsupported("a stream id out of range");
    return 0;
}

/* malloc: 0 and *out the block, 1 on OutOfMemory, -1 on error */
static int engine_malloc(Engine *m, int64_t orig_size, int64_t stream, int64_t event_index, int32_t *out) {
    if (check_request(orig_size, stream) < 0) return -1;
    int64_t size = round_size(m, orig_size);
    Pool *p = size <= SMALL_SIZE ? &m->small : &m->large;
    int32_t bi;
    Pos at;
    if (get_free_block(m, p, size, stream, &bi, &at) < 0) return -1;
    int pooled = bi >= 0; /* a free block of the pool serves it, left at `at` until it is split */
    if (!pooled) {
        int rc = new_block_for(m, p, size, stream, event_index, &bi);
        if (rc) return rc;
    }
    Block *b = BLK(bi);
    int64_t remaining = b->size - size;
    int split;
    if (b->small || m->expandable) split = remaining >= MIN_BLOCK;
    else split = (m->ms_unlimited || size < m->max_split_size) && remaining > SMALL_SIZE;
    if (split) {
        int32_t ri = split_after(m, bi, size);
        if (ri < 0) return -1;
        if ((pooled ? pool_replace(m, p, at, ri, 1) : pool_insert(m, p, ri)) < 0) return -1;
    } else if (pooled) {
        keys_erase(&p->keys, at);
    }
    b = BLK(bi);
    if (pooled) b->in_pool = 0;
    b->allocated = 1;
    if (add_checked(m->allocated, b->size, &m->allocated) < 0) return -1;
    if (m->allocated > m->peak_allocated) m->peak_allocated = m->allocated;
    *out = bi;
    return 0;
}

static int engine_free(Engine *m, int32_t bi) {
    Block *b = BLK(bi);
    b->allocated = 0;
    m->allocated -= b->size;
    Pool *p = pool_of(m, b->small);
    Pos hole;
    int holed = 0;
    if (merge_into_freed(m, bi, BLK(bi)->prev, p, &hole, &holed) < 0) return -1;
    if (merge_into_freed(m, bi, BLK(bi)->next, p, &hole, &holed) < 0) return -1;
    return holed ? pool_replace(m, p, hole, bi, 0) : pool_insert(m, p, bi);
}

/* needs_release: 1 when a malloc now would make the allocator give memory back first */
static int needs_release(Engine *m, int64_t orig_size, int64_t stream) {
    if (check_request(orig_size, stream) < 0) return -1;
    int64_t size = round_size(m, orig_size);
    Pool *p = size <= SMALL_SIZE ? &m->small : &m->large;
    Pos at = keys_find(&p->keys, stream, size, -1);
    if (!AT_END(&p->keys, at) && KEY(&p->keys, at)->stream == stream) {
        Block *b = BLK(KEY(&p->keys, at)->idx);
        int below = m->ms_unlimited || size < m->max_split_size;
        int fits = !(below && !m->ms_unlimited && b->size >= m->max_split_size) &&
                   !(!below && b->size >= size + m->max_non_split_rounding);
        if (fits) return 0;
    }
    if (m->gc) {
        if (m->reserved > (int64_t)(m->gc_threshold * (double)m->limit)) {
            FOR_EACH_KEY(&m->large.keys, pos)
                if (!IS_SPLIT(BLK(KEY(&m->large.keys, pos)->idx))) return 1;
        }
    }
    int64_t need = m->expandable ? size : allocation_size(size), total;
    if (add_checked(m->reserved, need, &total) < 0) return -1;
    return m->has_limit && total > m->limit;
}

/* ------------------------------------------------------------------------- Python interface */

static int get_int64(PyObject *o, int64_t *out, int64_t lo, int64_t hi, const char *what) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow || v < lo || v > hi) {
        PyErr_Format(Unsupported, "%s out of range", what);
        return -1;
    }
    *out = v;
    return 0;
}

static void engine_dealloc(Engine *m) {
    PyMem_Free(m->blocks);
    PyMem_Free(m->free_slots);
    Keys *pools[4] = {&m->small.keys, &m->small.unmapped, &m->large.keys, &m->large.unmapped};
    for (int i = 0; i < 4; i++) {
        for (Py_ssize_t c = 0; c < pools[i]->nchunks; c++) PyMem_Free(pools[i]->chunk[c].key);
        PyMem_Free(pools[i]->chunk);
        PyMem_Free(pools[i]->spare);
    }
    PyMem_Free(m->live.e);
    PyMem_Free(m->placed.e);
    PyMem_Free(m->segment_starts.e);
    PyMem_Free(m->recorded.e);
    for (Py_ssize_t i = 0; i < m->nqueues; i++) PyMem_Free(m->queues[i].data);
    PyMem_Free(m->queues);
    PyMem_Free(m->free_va);
    PyMem_Free(m->seg_base);
    PyMem_Free(m->seg_exp);
    PyMem_Free(m->ooms);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

/* Engine(max_split_size, max_non_split_rounding, divisions, gc_threshold, expandable, limit,
 *        limit_is_cap, top_down); max_split_size None: unlimited; limit None: no limit */
static int engine_init(Engine *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"max_split_size", "max_non_split_rounding", "divisions", "gc_threshold",
                             "expandable", "limit", "limit_is_cap", "top_down", NULL};
    PyObject *ms, *mnsr, *divisions, *limit;
    double gc;
    int expandable, limit_is_cap, top_down;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOdpOpp", kwlist, &ms, &mnsr, &divisions, &gc, &expandable,
                                     &limit, &limit_is_cap, &top_down))
        return -1;
    if (m->blocks) {
        PyErr_SetString(PyExc_RuntimeError, "an Engine is initialised once");
        return -1;
    }
    m->ms_unlimited = ms == Py_None;
    m->max_split_size = INT64_MAX;
    if (!m->ms_unlimited && get_int64(ms, &m->max_split_size, 0, MAX_SIZE * 4, "max_split_size") < 0) return -1;
    if (get_int64(mnsr, &m->max_non_split_rounding, -MAX_SIZE * 4, MAX_SIZE * 4, "max_non_split_rounding") < 0)
        return -1;
    PyObject *seq = PySequence_Fast(divisions, "divisions must be a sequence");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != 16) {
        Py_DECREF(seq);
        PyErr_SetString(Unsupported, "roundup_power2_divisions must have 16 entries");
        return -1;
    }
    for (int i = 0; i < 16; i++) {
        if (get_int64(PySequence_Fast_GET_ITEM(seq, i), &m->divisions[i], 0, 1 << 20, "a division") < 0) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    if (!(gc >= 0.0 && gc < 1.0)) {
        PyErr_SetString(Unsupported, "garbage_collection_threshold out of range");
        return -1;
    }
    m->gc_threshold = gc;
    m->expandable = expandable;
    m->has_limit = limit != Py_None;
    if (m->has_limit && get_int64(limit, &m->limit, -MAX_ADDRESS, MAX_ADDRESS, "memory limit") < 0) return -1;
    m->gc = m->has_limit && limit_is_cap && gc > 0;
    m->top_down = top_down;
    m->small.small = 1;
    m->next_addr = SYNTHETIC_BASE;
    /* the arena exists from here on (and marks the engine initialised) */
    if (reserve_items((void **)&m->blocks, &m->blocks_cap, 64, sizeof(Block)) < 0) return -1;
    return 0;
}

/* an int64 buffer of n items (n < 0: any length, set) */
typedef struct {
    Py_buffer view;
    int64_t *data;
    int held;
} Column;

static int get_column(PyObject *o, Column *c, Py_ssize_t *n, int writable, const char *name) {
    c->held = 0;
    c->data = NULL;
    if (o == Py_None) return 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, &c->view, flags) < 0) return -1;
    c->held = 1;
    const char *f = c->view.format ? c->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (c->view.itemsize != 8 || (strcmp(f, "q") != 0 && strcmp(f, "l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", name);
        return -1;
    }
    Py_ssize_t len = c->view.len / 8;
    if (*n < 0) *n = len;
    else if (len != *n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd items, expected %zd", name, len, *n);
        return -1;
    }
    c->data = (int64_t *)c->view.buf;
    return 0;
}

static void release_columns(Column *cols, int k) {
    for (int i = 0; i < k; i++)
        if (cols[i].held) PyBuffer_Release(&cols[i].view);
}

/* the key's entry, its block taken out of it (-1: none); deletes an emptied entry */
static int32_t take_live(Engine *m, Entry *e) {
    int32_t bi = (int32_t)e->value;
    e->value = -1;
    if (!e->pending) table_delete(&m->live, e);
    return bi;
}

/* one operation; 1 when an allocation ran out of memory (the stream stops there) */
static int run_one(Engine *m, int64_t kind, int64_t key, int64_t size, int64_t stream, int64_t index,
                   int64_t *block_size, int *avoided, int *decided) {
    int32_t bi;
    int rc;
    Entry *e;
    switch (kind) {
    case OP_ALLOC:
    case OP_ALLOC_KEEP:
    case OP_ALLOC_IF_ABSENT:
        if (kind == OP_ALLOC_IF_ABSENT && (e = table_find(&m->live, key)) && e->value >= 0) return 0;
        rc = engine_malloc(m, size, stream, index, &bi);
        if (rc) return rc;
        e = table_get_or_add(&m->live, key);
        if (!e) return -1;
        if (kind == OP_ALLOC && e->value >= 0) { /* a key allocated twice: the first is lost */
            int32_t old = (int32_t)e->value;
            if (sub_checked(m->level, BLK(old)->size, &m->level) < 0 || engine_free(m, old) < 0) return -1;
        }
        e->value = bi;
        *block_size = BLK(bi)->size;
        return add_checked(m->level, BLK(bi)->size, &m->level);
    case OP_FREE:
        e = table_find(&m->live, key);
        if (!e || e->value < 0) return 0;
        if (e->pending) {
            e->pending = 0;
            bi = take_live(m, e);
        } else {
            bi = take_live(m, e);
            if (sub_checked(m->level, BLK(bi)->size, &m->level) < 0) return -1;
        }
        return engine_free(m, bi);
    case OP_FREE_REQUESTED:
        e = table_find(&m->live, key);
        if (e && e->value >= 0 && !e->pending) {
            e->pending = 1;
            return sub_checked(m->level, BLK(e->value)->size, &m->level);
        }
        return 0;
    case OP_EMPTY_CACHE:
        return empty_cache(m);
    case OP_RECORD_ADDRESS:
        return record_address(m, size, key);
    case OP_OOM_PROBE:
        rc = engine_malloc(m, size, stream, index, &bi);
        if (rc < 0) return -1;
        *avoided = rc == 0 ? (*avoided == 0 ? 1 : *avoided) : 2; /* 0 none, 1 avoided, 2 not */
        return 0;
    case OP_TRY:
        rc = engine_malloc(m, size, stream, index, &bi);
        if (rc < 0) return -1;
        if (rc == 0) return engine_free(m, bi);
        m->nooms--; /* refused again: the program goes on, as the recorded one did */
        return 0;
    case OP_RELEASE_UNLESS_SERVED:
        rc = needs_release(m, size, stream);
        if (rc < 0) return -1;
        if (rc) return 0;
        *decided = 1;
        return empty_cache(m);
    case OP_NOP:
        return 0;
    default:
        PyErr_Format(PyExc_ValueError, "unknown operation kind %lld", (long long)kind);
        return -1;
    }
}

/* run(kind, key, size, stream, index, block_size_out, level_out) -> (stop, avoided, decided)
 * stop: the operation where an allocation ran out of memory (-1: none); avoided: None, True or
 * False (the OOM probes); decided: operations where OP_RELEASE_UNLESS_SERVED emptied the cache.
 * block_size_out (optional): the block size of each allocation; level_out (optional): the plan's
 * allocated bytes after each operation. */
static PyObject *engine_run(Engine *m, PyObject *args) {
    PyObject *objs[7];
    if (!PyArg_ParseTuple(args, "OOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6]))
        return NULL;
    if (!m->blocks) {
        PyErr_SetString(PyExc_RuntimeError, "Engine not initialised");
        return NULL;
    }
    static const char *names[7] = {"kind", "key", "size", "stream", "index", "block_size_out", "level_out"};
    Column cols[7];
    memset(cols, 0, sizeof cols);
    Py_ssize_t n = -1;
    PyObject *decided_list = PyList_New(0);
    if (!decided_list) return NULL;
    for (int i = 0; i < 7; i++) {
        if (i < 5 && objs[i] == Py_None) {
            PyErr_Format(PyExc_TypeError, "%s is required", names[i]);
            goto fail;
        }
        if (get_column(objs[i], &cols[i], &n, i >= 5, names[i]) < 0) goto fail;
    }
    Py_ssize_t stop = -1;
    int avoided = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t block_size = 0;
        int decided = 0;
        int rc = run_one(m, cols[0].data[i], cols[1].data[i], cols[2].data[i], cols[3].data[i], cols[4].data[i],
                         &block_size, &avoided, &decided);
        if (rc < 0) goto fail;
        if (rc == 1) {
            stop = i;
            break;
        }
        if (decided) {
            PyObject *at = PyLong_FromSsize_t(i);
            if (!at || PyList_Append(decided_list, at) < 0) {
                Py_XDECREF(at);
                goto fail;
            }
            Py_DECREF(at);
        }
        if (cols[5].data) cols[5].data[i] = block_size;
        if (cols[6].data) cols[6].data[i] = m->level;
    }
    release_columns(cols, 7);
    PyObject *avoided_obj = avoided == 0 ? Py_None : avoided == 1 ? Py_True : Py_False;
    return Py_BuildValue("nON", stop, avoided_obj, decided_list);
fail:
    release_columns(cols, 7);
    Py_DECREF(decided_list);
    return NULL;
}

/* a contiguous buffer of n one-byte flags (numpy bool or uint8) */
static int get_flags(PyObject *o, Py_buffer *view, Py_ssize_t n, const char *name) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@' || *f == '|') f++;
    if (view->itemsize != 1 || (strcmp(f, "?") != 0 && strcmp(f, "B") != 0) || view->len != n) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous bool array of %zd items", name, n);
        return -1;
    }
    return 0;
}

/* run_tape(which, is_free, size, stream) -> stop: fit's step (tape.py's simulate). Operation i
 * allocates row which[i] (is_free[i] false) or frees it; row r asks size[r] bytes on stream[r],
 * and a row of size 0 or less is not made (neither of its operations runs). What each row holds
 * is kept in an array by row, not in the engine's table of keys: OP_ALLOC_KEEP and OP_FREE with
 * the row as key, without the plan's level, and without a gather of every column per operation.
 * stop: the operation where an allocation ran out of memory (-1: none). */
static PyObject *engine_run_tape(Engine *m, PyObject *args) {
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "OOOO", &objs[0], &objs[1], &objs[2], &objs[3])) return NULL;
    if (!m->blocks) {
        PyErr_SetString(PyExc_RuntimeError, "Engine not initialised");
        return NULL;
    }
    Column cols[4];
    memset(cols, 0, sizeof cols);
    Py_buffer flags;
    int have_flags = 0;
    int32_t *live = NULL;
    Py_ssize_t n_ops = -1, n_rows = -1, stop = -1;
    if (get_column(objs[0], &cols[0], &n_ops, 0, "which") < 0) goto fail;
    if (get_column(objs[2], &cols[2], &n_rows, 0, "size") < 0) goto fail;
    if (get_column(objs[3], &cols[3], &n_rows, 0, "stream") < 0) goto fail;
    if (!cols[0].data || !cols[2].data || !cols[3].data) {
        PyErr_SetString(PyExc_TypeError, "which, size and stream are required");
        goto fail;
    }
    if (get_flags(objs[1], &flags, n_ops, "is_free") < 0) goto fail;
    have_flags = 1;
    live = PyMem_Malloc((size_t)(n_rows ? n_rows : 1) * sizeof(int32_t));
    if (!live) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t r = 0; r < n_rows; r++) live[r] = -1;
    const int64_t *which = cols[0].data, *size = cols[2].data, *stream = cols[3].data;
    const uint8_t *is_free = (const uint8_t *)flags.buf;
    for (Py_ssize_t i = 0; i < n_ops; i++) {
        int64_t r = which[i];
        if (r < 0 || r >= n_rows) {
            PyErr_Format(PyExc_ValueError, "operation %zd names row %lld of %zd", i, (long long)r, n_rows);
            goto fail;
        }
        if (size[r] <= 0) continue;
        int32_t bi;
        if (is_free[i]) {
            bi = live[r];
            if (bi < 0) continue;
            live[r] = -1;
            if (engine_free(m, bi) < 0) goto fail;
            continue;
        }
        int rc = engine_malloc(m, size[r], stream[r], -1, &bi);
        if (rc < 0) goto fail;
        if (rc == 1) {
            stop = i;
            break;
        }
        live[r] = bi;
    }
    PyMem_Free(live);
    PyBuffer_Release(&flags);
    release_columns(cols, 4);
    return PyLong_FromSsize_t(stop);
fail:
    PyMem_Free(live);
    if (have_flags) PyBuffer_Release(&flags);
    release_columns(cols, 4);
    return NULL;
}

/* stats() -> (reserved, peak_reserved, allocated, peak_allocated, cuda_malloc_calls,
 *             cuda_free_calls, alloc_retries, [(event index, size) of each OOM], level) */
static PyObject *engine_stats(Engine *m, PyObject *Py_UNUSED(ignored)) {
    PyObject *ooms = PyList_New(m->nooms);
    if (!ooms) return NULL;
    for (Py_ssize_t i = 0; i < m->nooms; i++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)m->ooms[2 * i], (long long)m->ooms[2 * i + 1]);
        if (!pair) {
            Py_DECREF(ooms);
            return NULL;
        }
        PyList_SET_ITEM(ooms, i, pair);
    }
    return Py_BuildValue("LLLLLLLNL", (long long)m->reserved, (long long)m->peak_reserved, (long long)m->allocated,
                         (long long)m->peak_allocated, (long long)m->malloc_calls, (long long)m->free_calls,
                         (long long)m->retries, ooms, (long long)m->level);
}

/* reset_stats(): _steady_replay's start of the measured pass */
static PyObject *engine_reset_stats(Engine *m, PyObject *Py_UNUSED(ignored)) {
    m->peak_reserved = m->reserved;
    m->peak_allocated = m->allocated;
    m->malloc_calls = m->free_calls = m->retries = 0;
    m->nooms = 0;
    Py_RETURN_NONE;
}

/* mark_placed(): remember which block every key holds now (_steady_replay's `placed`) */
static PyObject *engine_mark_placed(Engine *m, PyObject *Py_UNUSED(ignored)) {
    PyMem_Free(m->placed.e);
    memset(&m->placed, 0, sizeof m->placed);
    for (size_t j = 0; j < m->live.cap; j++) {
        Entry *e = &m->live.e[j];
        if (e->state != 1 || e->value < 0) continue;
        Entry *p = table_get_or_add(&m->placed, e->key);
        if (!p) return NULL;
        p->value = (int64_t)BLK(e->value)->serial; /* serials stay far below 2**63 */
    }
    Py_RETURN_NONE;
}

/* free_unplaced(): free every live block that is not the very block its key held at
 * mark_placed() (a block freed and handed back to the same key is the same block) */
static PyObject *engine_free_unplaced(Engine *m, PyObject *Py_UNUSED(ignored)) {
    for (size_t j = 0; j < m->live.cap; j++) {
        Entry *e = &m->live.e[j];
        if (e->state != 1 || e->value < 0) continue;
        Entry *p = table_find(&m->placed, e->key);
        if (p && (uint64_t)p->value == BLK(e->value)->serial) continue;
        if (e->pending) return PyErr_Format(Unsupported, "a pending free when bringing blocks back"), NULL;
        int32_t bi = take_live(m, e);
        if (engine_free(m, bi) < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* seed_chain(stream, small, expandable, start, booked, addrs, sizes, mapped, allocated):
 * model.seed_segment / seed_expandable, the chain of blocks laid out by the caller (native.py):
 * a new segment (an expandable range starting at `start`, else a segment registered at
 * `start`), `booked` bytes reserved without a limit check, the blocks linked in order, the
 * unmapped ones to the unmapped pool, the allocated ones live under their address, the rest
 * to their pool. */
static PyObject *engine_seed_chain(Engine *m, PyObject *args) {
    long long stream, start, booked;
    int small, expandable;
    PyObject *objs[4];
    if (!PyArg_ParseTuple(args, "LppLLOOOO", &stream, &small, &expandable, &start, &booked, &objs[0], &objs[1],
                          &objs[2], &objs[3]))
        return NULL;
    if (!m->blocks) {
        PyErr_SetString(PyExc_RuntimeError, "Engine not initialised");
        return NULL;
    }
    static const char *names[4] = {"addrs", "sizes", "mapped", "allocated"};
    Column cols[4];
    memset(cols, 0, sizeof cols);
    Py_ssize_t n = -1;
    for (int i = 0; i < 4; i++)
        if (get_column(objs[i], &cols[i], &n, 0, names[i]) < 0) goto fail;
    if (stream < -MAX_ADDRESS || stream > MAX_ADDRESS || start < -MAX_ADDRESS || start > MAX_ADDRESS ||
        booked < 0 || booked > MAX_ADDRESS) {
        unsupported("a seeded segment out of range");
        goto fail;
    }
    int64_t previous_end = 0;
    for (Py_ssize_t i = 0; i < n; i++) { /* blocks in increasing addresses, each of a sane size */
        int64_t a = cols[0].data[i], size = cols[1].data[i];
        if (a < -MAX_ADDRESS || a > MAX_ADDRESS || size <= 0 || size > MAX_ADDRESS || (i && a < previous_end)) {
            unsupported("seeded blocks that do not tile their segment");
            goto fail;
        }
        previous_end = a + size;
    }
    int64_t seg = new_segment_id(m, expandable, start);
    if (seg < 0) goto fail;
    if (!expandable && !table_get_or_add(&m->segment_starts, start)) goto fail;
    if (add_checked(m->reserved, booked, &m->reserved) < 0) goto fail;
    if (m->reserved > m->peak_reserved) m->peak_reserved = m->reserved;
    int32_t prev = -1, first = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t bi = new_block(m, cols[0].data[i], cols[1].data[i], stream, small, seg);
        if (bi < 0) goto fail;
        Block *b = BLK(bi);
        b->mapped = cols[2].data[i] != 0;
        b->prev = prev;
        if (prev >= 0) BLK(prev)->next = bi;
        else first = bi;
        prev = bi;
    }
    Py_ssize_t i = 0; /* place them, first to last */
    for (int32_t bi = first; bi >= 0; bi = BLK(bi)->next, i++) {
        Block *b = BLK(bi);
        Pool *p = pool_of(m, b->small);
        if (!b->mapped) {
            if (insert_unmapped(m, p, bi) < 0) goto fail;
        } else if (cols[3].data[i]) {
            b->allocated = 1;
            if (add_checked(m->allocated, b->size, &m->allocated) < 0) goto fail;
            Entry *e = table_get_or_add(&m->live, b->addr);
            if (!e) goto fail;
            e->value = bi;
        } else if (pool_insert(m, p, bi) < 0) {
            goto fail;
        }
    }
    if (m->allocated > m->peak_allocated) m->peak_allocated = m->allocated;
    release_columns(cols, 4);
    Py_RETURN_NONE;
fail:
    release_columns(cols, 4);
    return NULL;
}

/* layout() -> [[(block size, allocated), ...] per mapped range], as model.layout(live blocks) */
static PyObject *engine_layout(Engine *m, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    /* the heads among the live blocks and the free mapped ones */
    Py_ssize_t total = m->small.keys.len + m->large.keys.len + (Py_ssize_t)m->live.used;
    int32_t *seen = PyMem_Malloc((size_t)(total ? total : 1) * sizeof(int32_t));
    if (!seen) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    Py_ssize_t k = 0;
    for (size_t j = 0; j < m->live.cap; j++)
        if (m->live.e[j].state == 1 && m->live.e[j].value >= 0) seen[k++] = (int32_t)m->live.e[j].value;
    FOR_EACH_KEY(&m->small.keys, pos) seen[k++] = KEY(&m->small.keys, pos)->idx;
    FOR_EACH_KEY(&m->large.keys, pos) seen[k++] = KEY(&m->large.keys, pos)->idx;
    for (Py_ssize_t j = 0; j < k; j++) {
        Block *b = BLK(seen[j]);
        if (!b->mapped || (b->prev >= 0 && BLK(b->prev)->mapped)) continue;
        PyObject *chain = PyList_New(0);
        if (!chain || PyList_Append(out, chain) < 0) goto fail_chain;
        Py_DECREF(chain);
        for (int32_t cur = seen[j]; cur >= 0 && BLK(cur)->mapped; cur = BLK(cur)->next) {
            PyObject *item = Py_BuildValue("(LO)", (long long)BLK(cur)->size, BLK(cur)->allocated ? Py_True : Py_False);
            if (!item || PyList_Append(chain, item) < 0) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
        }
        continue;
    fail_chain:
        Py_XDECREF(chain);
        goto fail;
    }
    PyMem_Free(seen);
    return out;
fail:
    PyMem_Free(seen);
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef engine_methods[] = {
    {"run", (PyCFunction)engine_run, METH_VARARGS, "Replay a stream of operations (see the C source)."},
    {"run_tape", (PyCFunction)engine_run_tape, METH_VARARGS, "Replay fit's step, by row (see the C source)."},
    {"stats", (PyCFunction)engine_stats, METH_NOARGS, "The counters."},
    {"reset_stats", (PyCFunction)engine_reset_stats, METH_NOARGS, "Start a measured pass."},
    {"mark_placed", (PyCFunction)engine_mark_placed, METH_NOARGS, "Remember the live blocks."},
    {"free_unplaced", (PyCFunction)engine_free_unplaced, METH_NOARGS, "Free blocks not marked."},
    {"seed_chain", (PyCFunction)engine_seed_chain, METH_VARARGS, "A segment that existed before the trace."},
    {"layout", (PyCFunction)engine_layout, METH_NOARGS, "Mapped ranges as (size, allocated) lists."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "snapshot_lab.metrics.allocator._replay.Engine",
    .tp_basicsize = sizeof(Engine),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The caching-allocator model of model.py, compiled.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)engine_init,
    .tp_dealloc = (destructor)engine_dealloc,
    .tp_methods = engine_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_replay", "The allocator model's replay, compiled (see native.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__replay(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (!mod) return NULL;
    Unsupported = PyErr_NewException("snapshot_lab.metrics.allocator._replay.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObject(mod, "Unsupported", Unsupported) < 0) goto fail;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(mod, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        goto fail;
    }
    return mod;
fail:
    Py_XDECREF(Unsupported);
    Py_DECREF(mod);
    return NULL;
}
