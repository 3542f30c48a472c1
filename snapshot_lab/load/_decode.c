/* A pickle reader for memory snapshots that turns device_traces straight into columns: the fast
 * path of snapshot_lab/load/loader.py (load/decoded.py holds its Python side).
 *
 * decode(buffer, oom_name, release=False, on_progress=None, keep=0)
 *     -> None | (root, None) | (root, (devices, stacks))
 *
 * It runs the opcodes that torch's snapshots use (protocol 2 to 5: PROTO FRAME STOP MARK
 * EMPTY_DICT EMPTY_LIST EMPTY_TUPLE TUPLE TUPLE1-3 SETITEM(S) APPEND(S) MEMOIZE (LONG_)BINPUT
 * (LONG_)BINGET BININT BININT1 BININT2 LONG1 BINFLOAT NONE NEWTRUE NEWFALSE (SHORT_)BINUNICODE
 * BINUNICODE8) and builds every object outside device_traces exactly as pickle.load does. Inside
 * device_traces the entry dicts are never built: their fields go into per-device columns, and
 * each entry's frames list becomes a "stack key", an index into a table of distinct sequences of
 * frame objects (the frame dicts themselves are built normally and shared through the memo).
 *
 * Anything else (another opcode, truncation, a bad memo index, a stack underflow, a reference to
 * an object that exists only as columns, a field of a type or range the Python path would refuse,
 * limits) gives None: the caller then reads the file with the restricted unpickler, which is the
 * reference and which gives the exact error. So this file has no error messages; only the
 * regular case must be right, and every input must be safe (every read is bounds-checked).
 *
 * devices: tuple, one item per device ordinal: (n, action int16, action_names, size, addr,
 * stream, time_us, device_free int64, metadata int32, metadata_names, stack int64, forward,
 * hints, pools, contexts, dropped) where the columns are bytearrays of native-endian values, INT64_MIN marks an absent
 * int, action/metadata are codes into their names lists (first appearance order; metadata
 * code 0 is ''), forward is a dict {row: forward_frames list}, hints the bit set of the keys
 * of the device's first entry (1 time_us, 2 compile_context, 4 user_metadata, 8 pool_id), pools a
 * dict {row: pool_id tuple} of the entries whose pool is not (0, 0) and contexts a dict {row:
 * compile_context} of those whose compiled region is not 'N/A' (torch's pybind serialiser,
 * THCPModule_memorySnapshot in torch/csrc/cuda/Module.cpp, writes both on every entry), and
 * dropped the number of the device's first entries left out by the window.
 * keep > 0 is the window: each device's columns hold its last `keep` entries only, as if torch had
 * recorded them with max_entries=keep (their rows are numbered from the first kept); the older
 * ones are dropped as the reading goes on, so the columns never hold much more than `keep` rows.
 * stacks: list of tuples of frame objects; the stack key indexes it; key 0 is () (no frames).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#define MISSING INT64_MIN
#define MAX_STACK (1 << 24)
#define MAX_MARKS (1 << 20)
#define MAX_DEVICES 65536
#define N_BUILDERS 16
#define MAX_CODES 30000

enum { K_OBJ, K_INT, K_DEVICES, K_TRACE, K_ENTRY, K_FRAMES, K_FRAMESREF };

typedef struct {
    PyObject *obj; /* owned, K_OBJ only */
    int64_t val;   /* K_INT: the value; K_ENTRY: row; K_FRAMES: generation; K_FRAMESREF: stack key */
    int32_t kind;
    int32_t aux; /* K_TRACE, K_ENTRY: device; K_FRAMES: builder */
} Item;

/* memo slots: a PyObject* (owned, low bits 0), or a tagged value. Under a window (keep > 0) a
 * chunk of slots that holds only tagged values (entries and their finished frames lists: one or
 * two a trace entry) is given back once two newer chunks exist, so the memo does not grow with
 * the trace; a reference to a slot given back gives up (the Python path reads the file). */
#define MEMO_CHUNK_BITS 12
#define MEMO_CHUNK ((Py_ssize_t)1 << MEMO_CHUNK_BITS)
enum { M_OPAQUE = 1, M_PENDING = 2, M_DONE = 3 };
#define MEMO_TAG(v) ((uintptr_t)(v) & 7u)
#define MEMO_VAL(v) ((int64_t)((uintptr_t)(v) >> 3))
#define MEMO_MAKE(tag, val) ((PyObject *)(((uintptr_t)(val) << 3) | (uintptr_t)(tag)))

enum { FL_ACTION = 1, FL_SIZE = 2, FL_FREE_BAD = 4 };

typedef struct {
    Py_ssize_t n, cap;   /* n: rows made (entries seen); cap: rows the columns hold room for */
    Py_ssize_t appended;
    Py_ssize_t keep, base; /* the window: keep the last `keep` rows (0: all); rows before `base` were dropped */
    int16_t *action;
    int64_t *size, *addr, *stream, *time, *free, *stack;
    int32_t *meta;
    uint8_t *flags;
    PyObject *action_codes, *action_names, *meta_codes, *meta_names, *forward;
    PyObject *pools, *contexts; /* {row: pool_id} other than (0, 0); {row: compile_context} other than 'N/A' */
    long oom_code;
    int hints;
} Device;

typedef struct {
    PyObject **items;
    Py_ssize_t n, cap;
    int64_t generation;
    Py_ssize_t memo_index;
    int in_use;
} Builder;

typedef struct {
    uint64_t hash;
    int64_t key; /* -1: empty */
} StackSlot;

enum {
    F_OTHER,
    F_ACTION,
    F_SIZE,
    F_ADDR,
    F_STREAM,
    F_TIME,
    F_FREE,
    F_META,
    F_FRAMES,
    F_FORWARD,
    F_COMPILE,
    F_POOL,
};
#define KEY_CACHE 32

typedef struct {
    const char *p, *end;
    const char *start, *released; /* release: pages before `released` were given back */
    int release;
    PyObject *on_progress; /* called with the offset read so far, every PROGRESS_STEP bytes; or NULL */
    const char *reported;
    Item *stack;
    Py_ssize_t len, cap;
    Py_ssize_t *marks;
    Py_ssize_t nmarks, marks_cap;
    PyObject ***memo_chunks; /* the memo in chunks of MEMO_CHUNK slots; NULL: a chunk given back (window) */
    Py_ssize_t memo_len, memo_nchunks, memo_chunks_cap;
    PyObject *root;
    int devices_made, devices_set;
    Device *devices;
    Py_ssize_t n_devices, devices_cap;
    Py_ssize_t devices_appended;
    Builder builders[N_BUILDERS];
    int64_t generations;
    PyObject *stacks; /* list of tuples */
    StackSlot *slots;
    size_t slots_mask;
    PyObject *used_lists;    /* {id: (list, stack key)} of real lists used as an entry's frames */
    PyObject *forward_lists; /* {id: list} of the lists used as an entry's forward_frames */
    PyObject *key_objs[KEY_CACHE];
    int key_fields[KEY_CACHE];
    int key_next;
    PyObject *oom_name;
    Py_ssize_t keep; /* each device's window (0: every entry) */
} VM;

/* ---------- growth helpers ---------- */

static int grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t width) {
    if (need <= *cap) {
        return 0;
    }
    Py_ssize_t size = *cap ? *cap : 16;
    while (size < need) {
        if (size > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)width) {
            return -1;
        }
        size *= 2;
    }
    void *fresh = PyMem_Realloc(*buf, (size_t)size * width);
    if (fresh == NULL) {
        return -1;
    }
    *buf = fresh;
    *cap = size;
    return 0;
}

/* the memo's slot `index`, or NULL: beyond its end, or in a chunk given back */
static inline PyObject **memo_slot(VM *vm, uint64_t index) {
    if (index >= (uint64_t)vm->memo_len) {
        return NULL;
    }
    PyObject **chunk = vm->memo_chunks[index >> MEMO_CHUNK_BITS];
    return chunk != NULL ? &chunk[index & (uint64_t)(MEMO_CHUNK - 1)] : NULL;
}

static int push_slow(VM *vm, PyObject *obj) {
    if (vm->len >= MAX_STACK || grow((void **)&vm->stack, &vm->cap, vm->len + 1, sizeof(Item)) < 0) {
        Py_XDECREF(obj);
        return -1;
    }
    return 0;
}

/* push one item (obj owned, for K_OBJ) */
static inline int push4(VM *vm, PyObject *obj, int64_t val, int32_t kind, int32_t aux) {
    if (vm->len >= vm->cap && push_slow(vm, obj) < 0) {
        return -1;
    }
    Item *it = &vm->stack[vm->len++];
    it->obj = obj;
    it->val = val;
    it->kind = kind;
    it->aux = aux;
    return 0;
}

static inline int push_obj(VM *vm, PyObject *obj) { /* steals obj; NULL fails */
    if (obj == NULL) {
        return -1;
    }
    return push4(vm, obj, 0, K_OBJ, 0);
}

static void release(Item *it) {
    if (it->kind == K_OBJ) {
        Py_CLEAR(it->obj);
    }
}

static Py_ssize_t fence(VM *vm) { return vm->nmarks ? vm->marks[vm->nmarks - 1] : 0; }

/* a real object for an item (new reference), or NULL for a tagged one */
static PyObject *materialise(Item *it) {
    if (it->kind == K_OBJ) {
        Py_INCREF(it->obj);
        return it->obj;
    }
    if (it->kind == K_INT) {
        return PyLong_FromLongLong(it->val);
    }
    return NULL;
}

/* ---------- stack keys: distinct sequences of frame objects ---------- */

static uint64_t hash_ptrs(PyObject **items, Py_ssize_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        h ^= (uint64_t)(uintptr_t)items[i];
        h *= 0xC2B2AE3D27D4EB4FULL;
        h ^= h >> 29;
    }
    return h;
}

static int stacks_rehash(VM *vm) {
    size_t size = (vm->slots_mask + 1) * 2;
    StackSlot *fresh = PyMem_Malloc(size * sizeof(StackSlot));
    if (fresh == NULL) {
        return -1;
    }
    for (size_t i = 0; i < size; i++) {
        fresh[i].key = -1;
    }
    for (size_t i = 0; i <= vm->slots_mask; i++) {
        if (vm->slots[i].key >= 0) {
            size_t j = (size_t)vm->slots[i].hash & (size - 1);
            while (fresh[j].key >= 0) {
                j = (j + 1) & (size - 1);
            }
            fresh[j] = vm->slots[i];
        }
    }
    PyMem_Free(vm->slots);
    vm->slots = fresh;
    vm->slots_mask = size - 1;
    return 0;
}

/* the key of a sequence of frame objects (borrowed), a new key when never seen; -1 on failure */
static int64_t stack_key(VM *vm, PyObject **items, Py_ssize_t n) {
    if (n == 0) {
        return 0;
    }
    uint64_t h = hash_ptrs(items, n);
    size_t i = (size_t)h & vm->slots_mask;
    while (vm->slots[i].key >= 0) {
        if (vm->slots[i].hash == h) {
            PyObject *t = PyList_GET_ITEM(vm->stacks, vm->slots[i].key);
            if (PyTuple_GET_SIZE(t) == n && memcmp(&PyTuple_GET_ITEM(t, 0), items, (size_t)n * sizeof(PyObject *)) == 0) {
                return vm->slots[i].key;
            }
        }
        i = (i + 1) & vm->slots_mask;
    }
    PyObject *t = PyTuple_New(n);
    if (t == NULL) {
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(items[k]);
        PyTuple_SET_ITEM(t, k, items[k]);
    }
    int64_t key = PyList_GET_SIZE(vm->stacks);
    if (PyList_Append(vm->stacks, t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    Py_DECREF(t);
    vm->slots[i].hash = h;
    vm->slots[i].key = key;
    if ((size_t)(key + 1) * 2 > vm->slots_mask + 1 && stacks_rehash(vm) < 0) {
        return -1;
    }
    return key;
}

/* The stack key of a real list used as an entry's frames, each list hashed once (a list shared
   by many entries costs one lookup each, as in the Python path); the list is kept alive and must
   not change after (is_used). -1 on failure. */
static int64_t list_key(VM *vm, PyObject *list) {
    PyObject *id = PyLong_FromVoidPtr(list);
    if (id == NULL) {
        return -1;
    }
    int64_t key = -1;
    PyObject *known = PyDict_GetItemWithError(vm->used_lists, id);
    if (known != NULL) {
        key = PyLong_AsLongLong(PyTuple_GET_ITEM(known, 1));
    } else if (!PyErr_Occurred()) {
        key = stack_key(vm, ((PyListObject *)list)->ob_item, PyList_GET_SIZE(list));
        PyObject *entry = key < 0 ? NULL : Py_BuildValue("(OL)", list, (long long)key);
        if (entry == NULL || PyDict_SetItem(vm->used_lists, id, entry) < 0) {
            key = -1;
        }
        Py_XDECREF(entry);
    }
    Py_DECREF(id);
    return key;
}

static int mark_forward(VM *vm, PyObject *list) {
    PyObject *id = PyLong_FromVoidPtr(list);
    if (id == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(vm->forward_lists, id, list);
    Py_DECREF(id);
    return rc;
}

/* 1 when a real list was used as an entry's frames or forward_frames (so it must not change
   any more), -1 on failure */
static int is_used(VM *vm, PyObject *list) {
    if (PyDict_GET_SIZE(vm->used_lists) == 0 && PyDict_GET_SIZE(vm->forward_lists) == 0) {
        return 0;
    }
    PyObject *id = PyLong_FromVoidPtr(list);
    if (id == NULL) {
        return -1;
    }
    int rc = PyDict_Contains(vm->used_lists, id);
    if (rc == 0) {
        rc = PyDict_Contains(vm->forward_lists, id);
    }
    Py_DECREF(id);
    return rc;
}

/* ---------- devices ---------- */

static Device *new_device(VM *vm) {
    if (vm->n_devices >= MAX_DEVICES ||
        grow((void **)&vm->devices, &vm->devices_cap, vm->n_devices + 1, sizeof(Device)) < 0) {
        return NULL;
    }
    Device *d = &vm->devices[vm->n_devices];
    memset(d, 0, sizeof(Device));
    d->oom_code = -1;
    d->keep = vm->keep;
    vm->n_devices++;
    d->action_codes = PyDict_New();
    d->action_names = PyList_New(0);
    d->meta_codes = PyDict_New();
    d->meta_names = PyList_New(0);
    d->forward = PyDict_New();
    d->pools = PyDict_New();
    d->contexts = PyDict_New();
    if (!d->action_codes || !d->action_names || !d->meta_codes || !d->meta_names || !d->forward || !d->pools ||
        !d->contexts) {
        return NULL;
    }
    PyObject *empty = PyUnicode_FromStringAndSize("", 0);
    PyObject *zero = PyLong_FromLong(0);
    int rc = (empty && zero) ? PyDict_SetItem(d->meta_codes, empty, zero) | PyList_Append(d->meta_names, empty) : -1;
    Py_XDECREF(empty);
    Py_XDECREF(zero);
    return rc < 0 ? NULL : d;
}

static void free_device(Device *d) {
    PyMem_Free(d->action);
    PyMem_Free(d->size);
    PyMem_Free(d->addr);
    PyMem_Free(d->stream);
    PyMem_Free(d->time);
    PyMem_Free(d->free);
    PyMem_Free(d->stack);
    PyMem_Free(d->meta);
    PyMem_Free(d->flags);
    Py_XDECREF(d->action_codes);
    Py_XDECREF(d->action_names);
    Py_XDECREF(d->meta_codes);
    Py_XDECREF(d->meta_names);
    Py_XDECREF(d->forward);
    Py_XDECREF(d->pools);
    Py_XDECREF(d->contexts);
}

/* the rows of a sparse column {row: value} from `base` on (the others were dropped): 0, or -1 */
static int prune_before(PyObject *dict, Py_ssize_t base) {
    if (PyDict_GET_SIZE(dict) == 0) {
        return 0;
    }
    PyObject *gone = PyList_New(0);
    if (gone == NULL) {
        return -1;
    }
    Py_ssize_t pos = 0;
    PyObject *row, *value;
    int rc = 0;
    while (rc == 0 && PyDict_Next(dict, &pos, &row, &value)) {
        Py_ssize_t r = PyLong_AsSsize_t(row);
        rc = (r == -1 && PyErr_Occurred()) ? -1 : r < base ? PyList_Append(gone, row) : 0;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(gone); i++) {
        rc = PyDict_DelItem(dict, PyList_GET_ITEM(gone, i));
    }
    Py_DECREF(gone);
    return rc;
}

/* the window: drop the oldest rows already appended to the trace, so that the last `keep` stay
   (rows still being built or waiting for their APPENDS are never dropped): 0, or -1 */
static int drop_front(Device *d) {
    Py_ssize_t held = d->n - d->base;
    Py_ssize_t drop = held - d->keep;
    if (drop > d->appended - d->base) {
        drop = d->appended - d->base;
    }
    if (drop <= 0) {
        return 0;
    }
    Py_ssize_t left = held - drop;
#define SHIFT(field) memmove(d->field, d->field + drop, (size_t)left * sizeof(*d->field));
    SHIFT(action)
    SHIFT(size)
    SHIFT(addr)
    SHIFT(stream)
    SHIFT(time)
    SHIFT(free)
    SHIFT(stack)
    SHIFT(meta)
    SHIFT(flags)
#undef SHIFT
    d->base += drop;
    if (prune_before(d->forward, d->base) < 0 || prune_before(d->pools, d->base) < 0 ||
        prune_before(d->contexts, d->base) < 0) {
        return -1;
    }
    return 0;
}

/* a new row with every field absent; its number (rows are numbered from the trace's first
   entry; the columns hold rows from d->base on), or -1 */
static Py_ssize_t new_row(Device *d) {
    if (d->keep > 0 && d->n - d->base >= d->keep + d->keep / 4 + 64 && drop_front(d) < 0) {
        return -1;
    }
    Py_ssize_t r = d->n - d->base;
    if (r >= d->cap) {
        Py_ssize_t need = r + 1, cap;
#define GROW(field, width)                                                                                            \
    cap = d->cap;                                                                                                     \
    if (grow((void **)&d->field, &cap, need, width) < 0) return -1;
        GROW(action, 2)
        GROW(size, 8)
        GROW(addr, 8)
        GROW(stream, 8)
        GROW(time, 8)
        GROW(free, 8)
        GROW(stack, 8)
        GROW(meta, 4)
        GROW(flags, 1)
#undef GROW
        d->cap = cap;
    }
    d->n++;
    d->action[r] = -1;
    d->size[r] = 0;
    d->addr[r] = MISSING;
    d->stream[r] = 0;
    d->time[r] = MISSING;
    d->free[r] = MISSING;
    d->stack[r] = 0;
    d->meta[r] = 0;
    d->flags[r] = 0;
    return d->base + r;
}

/* code of a string in (codes, names), added when new; -1 on failure or too many */
static long code_of(PyObject *codes, PyObject *names, PyObject *s) {
    PyObject *c = PyDict_GetItemWithError(codes, s);
    if (c != NULL) {
        return PyLong_AsLong(c);
    }
    if (PyErr_Occurred()) {
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(names);
    if (n >= MAX_CODES) {
        return -1;
    }
    PyObject *code = PyLong_FromSsize_t(n);
    if (code == NULL) {
        return -1;
    }
    int rc = PyDict_SetItem(codes, s, code);
    Py_DECREF(code);
    if (rc < 0 || PyList_Append(names, s) < 0) {
        return -1;
    }
    return (long)n;
}

/* ---------- entries ---------- */

static const char *FIELD_NAMES[] = {NULL,     "action",        "size",          "addr",           "stream",
                                    "time_us", "device_free", "user_metadata", "frames", "forward_frames",
                                    "compile_context", "pool_id"};

static int field_of(VM *vm, PyObject *key) {
    for (int i = 0; i < KEY_CACHE; i++) {
        if (vm->key_objs[i] == key) {
            return vm->key_fields[i];
        }
    }
    int field = F_OTHER;
    for (int f = F_ACTION; f <= F_POOL; f++) {
        if (PyUnicode_CompareWithASCIIString(key, FIELD_NAMES[f]) == 0) {
            field = f;
            break;
        }
    }
    int slot = vm->key_next;
    vm->key_next = (vm->key_next + 1) % KEY_CACHE;
    Py_XDECREF(vm->key_objs[slot]);
    Py_INCREF(key);
    vm->key_objs[slot] = key;
    vm->key_fields[slot] = field;
    return field;
}

static int int_value(Item *v, int64_t lo, int64_t *out) {
    if (v->kind != K_INT || v->val < lo) {
        return -1;
    }
    *out = v->val;
    return 0;
}

/* the key of a frames list finished in builder b; -1 on failure */
static int64_t finish_builder(VM *vm, Item *v) {
    Builder *b = &vm->builders[v->aux];
    if (!b->in_use || b->generation != v->val) {
        return -1;
    }
    int64_t key = stack_key(vm, b->items, b->n);
    for (Py_ssize_t k = 0; k < b->n; k++) {
        Py_DECREF(b->items[k]);
    }
    b->n = 0;
    b->in_use = 0;
    PyObject **slot = key >= 0 && b->memo_index >= 0 ? memo_slot(vm, (uint64_t)b->memo_index) : NULL;
    if (slot != NULL && MEMO_TAG(*slot) == M_PENDING && MEMO_VAL(*slot) == b->generation) {
        *slot = MEMO_MAKE(M_DONE, key);
    }
    return key;
}

static int set_frames(VM *vm, Device *d, Py_ssize_t r, Item *v) {
    int64_t key;
    if (v->kind == K_FRAMES) {
        key = finish_builder(vm, v);
        v->kind = K_INT; /* consumed */
    } else if (v->kind == K_FRAMESREF) {
        key = v->val;
    } else if (v->kind == K_OBJ && PyList_CheckExact(v->obj)) {
        key = list_key(vm, v->obj);
    } else {
        return -1;
    }
    if (key < 0) {
        return -1;
    }
    d->stack[r] = key;
    return 0;
}

/* row -> value in a sparse column (value NULL: the default, so the row is dropped): 0, or -1 */
static int sparse_set(PyObject *dict, Py_ssize_t r, PyObject *value) {
    PyObject *row = PyLong_FromSsize_t(r);
    if (row == NULL) {
        return -1;
    }
    int rc;
    if (value == NULL) {
        rc = PyDict_Contains(dict, row);
        rc = rc < 0 ? -1 : rc ? PyDict_DelItem(dict, row) : 0;
    } else {
        rc = PyDict_SetItem(dict, row, value);
    }
    Py_DECREF(row);
    return rc;
}

/* an entry's pool_id (torch >= 2.12): a tuple of two int64; kept when it is not (0, 0) */
static int set_pool(Device *d, Py_ssize_t r, Item *v) {
    if (v->kind != K_OBJ || !PyTuple_CheckExact(v->obj) || PyTuple_GET_SIZE(v->obj) != 2) {
        return -1;
    }
    int zero = 1;
    for (Py_ssize_t i = 0; i < 2; i++) {
        PyObject *x = PyTuple_GET_ITEM(v->obj, i);
        int overflow = 0;
        if (!PyLong_CheckExact(x)) {
            return -1;
        }
        long long val = PyLong_AsLongLongAndOverflow(x, &overflow);
        if (overflow || (val == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return -1;
        }
        zero &= val == 0;
    }
    return sparse_set(d->pools, r, zero ? NULL : v->obj);
}

/* one key and value written into an entry's row: 0, or -1 for the Python path */
static int entry_set(VM *vm, Item *entry, Item *k, Item *v) {
    Device *d = &vm->devices[entry->aux];
    Py_ssize_t row = (Py_ssize_t)entry->val, r = row - d->base; /* the entry's number; its place in the columns */
    if (k->kind != K_OBJ || !PyUnicode_CheckExact(k->obj)) {
        return -1;
    }
    int field = field_of(vm, k->obj);
    if (row == 0) {
        d->hints |= field == F_TIME ? 1 : field == F_COMPILE ? 2 : field == F_META ? 4 : field == F_POOL ? 8 : 0;
    }
    long code;
    switch (field) {
    case F_ACTION:
        if (v->kind != K_OBJ || !PyUnicode_CheckExact(v->obj)) {
            return -1;
        }
        code = code_of(d->action_codes, d->action_names, v->obj);
        if (code < 0) {
            return -1;
        }
        if (d->oom_code < 0 && PyUnicode_Compare(v->obj, vm->oom_name) == 0) {
            d->oom_code = code;
        }
        d->action[r] = (int16_t)code;
        d->flags[r] |= FL_ACTION;
        return 0;
    case F_SIZE:
        d->flags[r] |= FL_SIZE;
        return int_value(v, 0, &d->size[r]);
    case F_ADDR:
        return int_value(v, 0, &d->addr[r]);
    case F_STREAM:
        return int_value(v, INT64_MIN, &d->stream[r]);
    case F_TIME:
        return int_value(v, 0, &d->time[r]);
    case F_FREE:
        d->flags[r] &= (uint8_t)~FL_FREE_BAD;
        d->free[r] = MISSING;
        if (v->kind == K_OBJ && v->obj == Py_None) {
            return 0;
        }
        if (int_value(v, 0, &d->free[r]) < 0) {
            d->flags[r] |= FL_FREE_BAD; /* refused only when the action is oom */
        }
        return 0;
    case F_META:
        if (v->kind != K_OBJ || !PyUnicode_CheckExact(v->obj)) {
            return -1;
        }
        code = code_of(d->meta_codes, d->meta_names, v->obj);
        if (code < 0) {
            return -1;
        }
        d->meta[r] = (int32_t)code;
        return 0;
    case F_FRAMES:
        return set_frames(vm, d, r, v);
    case F_FORWARD: {
        PyObject *key = PyLong_FromSsize_t(row);
        if (key == NULL) {
            return -1;
        }
        int rc;
        if (v->kind == K_OBJ && v->obj == Py_None) {
            rc = PyDict_Contains(d->forward, key);
            rc = rc < 0 ? -1 : rc ? PyDict_DelItem(d->forward, key) : 0;
        } else if (v->kind == K_OBJ && PyList_CheckExact(v->obj)) {
            rc = mark_forward(vm, v->obj) < 0 ? -1 : PyDict_SetItem(d->forward, key, v->obj);
        } else {
            rc = -1;
        }
        Py_DECREF(key);
        return rc;
    }
    case F_COMPILE:
        if (v->kind != K_OBJ || !PyUnicode_CheckExact(v->obj)) {
            return -1;
        }
        return sparse_set(d->contexts, row, PyUnicode_CompareWithASCIIString(v->obj, "N/A") == 0 ? NULL : v->obj);
    case F_POOL:
        return set_pool(d, row, v);
    default:
        /* a key the Python path ignores: any built value will do */
        return (v->kind == K_OBJ || v->kind == K_INT) ? 0 : -1;
    }
}

/* an entry appended to its device's trace: 0, or -1 */
static int entry_done(VM *vm, Item *trace, Item *entry) {
    if (entry->kind != K_ENTRY || entry->aux != trace->aux) {
        return -1;
    }
    Device *d = &vm->devices[trace->aux];
    if ((Py_ssize_t)entry->val != d->appended) {
        return -1;
    }
    Py_ssize_t r = d->appended - d->base;
    uint8_t f = d->flags[r];
    if (!(f & FL_ACTION) || !(f & FL_SIZE)) {
        return -1;
    }
    if (d->action[r] == d->oom_code) {
        if (f & FL_FREE_BAD) {
            return -1;
        }
    } else {
        d->free[r] = MISSING;
    }
    d->appended++;
    return 0;
}

/* ---------- containers ---------- */

/* pop the items from x on (after their values were moved or copied) */
static void pop_to(VM *vm, Py_ssize_t x) {
    while (vm->len > x) {
        release(&vm->stack[--vm->len]);
    }
}

static int append_items(VM *vm, Py_ssize_t x) {
    if (x > vm->len || x <= fence(vm)) {
        return -1;
    }
    if (x == vm->len) {
        return 0;
    }
    Item *c = &vm->stack[x - 1];
    for (Py_ssize_t i = x; i < vm->len; i++) {
        Item *it = &vm->stack[i];
        if (c->kind == K_DEVICES) {
            if (it->kind != K_TRACE || it->aux != vm->devices_appended) {
                return -1;
            }
            vm->devices_appended++;
        } else if (c->kind == K_TRACE) {
            if (entry_done(vm, c, it) < 0) {
                return -1;
            }
        } else if (c->kind == K_FRAMES) {
            Builder *b = &vm->builders[c->aux];
            if (it->kind != K_OBJ || grow((void **)&b->items, &b->cap, b->n + 1, sizeof(PyObject *)) < 0) {
                return -1;
            }
            b->items[b->n++] = it->obj; /* moved */
            it->obj = NULL;
            it->kind = K_INT;
        } else if (c->kind == K_OBJ && PyList_CheckExact(c->obj)) {
            if (is_used(vm, c->obj) != 0) {
                return -1;
            }
            PyObject *v = materialise(it);
            if (v == NULL) {
                return -1;
            }
            int rc = PyList_Append(c->obj, v);
            Py_DECREF(v);
            if (rc < 0) {
                return -1;
            }
        } else {
            return -1;
        }
    }
    pop_to(vm, x);
    return 0;
}

static int is_ascii(PyObject *s, const char *text) {
    return s != NULL && PyUnicode_CheckExact(s) && PyUnicode_CompareWithASCIIString(s, text) == 0;
}

static int set_items(VM *vm, Py_ssize_t x) {
    if (x > vm->len || x <= fence(vm)) {
        return -1;
    }
    if (x == vm->len) {
        return 0;
    }
    if ((vm->len - x) % 2 != 0) {
        return -1;
    }
    Item *c = &vm->stack[x - 1];
    for (Py_ssize_t i = x; i < vm->len; i += 2) {
        Item *k = &vm->stack[i], *v = &vm->stack[i + 1];
        if (c->kind == K_ENTRY) {
            if (entry_set(vm, c, k, v) < 0) {
                return -1;
            }
            continue;
        }
        if (c->kind != K_OBJ || !PyDict_CheckExact(c->obj)) {
            return -1;
        }
        PyObject *key = materialise(k);
        if (key == NULL) {
            return -1;
        }
        PyObject *value;
        int traces_key = c->obj == vm->root && is_ascii(key, "device_traces");
        if (traces_key && vm->devices_set) {
            Py_DECREF(key);
            return -1; /* set twice: the columns would not be what pickle.load gives */
        }
        if (v->kind == K_DEVICES && traces_key) {
            value = PyList_New(0); /* the decoded traces stand for it */
            vm->devices_set = 1;
        } else {
            value = materialise(v);
        }
        if (value == NULL) {
            Py_DECREF(key);
            return -1;
        }
        int rc = PyDict_SetItem(c->obj, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (rc < 0) {
            return -1;
        }
    }
    pop_to(vm, x);
    return 0;
}

static int make_tuple(VM *vm, Py_ssize_t x) {
    if (x > vm->len || x < fence(vm)) {
        return -1;
    }
    PyObject *t = PyTuple_New(vm->len - x);
    if (t == NULL) {
        return -1;
    }
    for (Py_ssize_t i = x; i < vm->len; i++) {
        PyObject *v = materialise(&vm->stack[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return -1;
        }
        PyTuple_SET_ITEM(t, i - x, v);
    }
    pop_to(vm, x);
    return push_obj(vm, t);
}

static Py_ssize_t pop_mark(VM *vm) {
    if (vm->nmarks == 0) {
        return -1;
    }
    return vm->marks[--vm->nmarks];
}

/* ---------- memo ---------- */

/* under a window, the chunk two before the newest given back when it holds only tagged values
   other than a pending frames list (nothing a later reference could need but the Python path) */
static void memo_forget_old(VM *vm) {
    Py_ssize_t c = vm->memo_nchunks - 3;
    if (vm->keep <= 0 || c < 0 || vm->memo_chunks[c] == NULL) {
        return;
    }
    PyObject **chunk = vm->memo_chunks[c];
    for (Py_ssize_t i = 0; i < MEMO_CHUNK; i++) {
        uintptr_t tag = MEMO_TAG(chunk[i]);
        if (chunk[i] == NULL || tag == 0 || tag == M_PENDING) {
            return;
        }
    }
    PyMem_Free(chunk);
    vm->memo_chunks[c] = NULL;
}

/* a new slot at the memo's end (a chunk added when the last is full): its address, or NULL */
static PyObject **memo_append(VM *vm) {
    if ((vm->memo_len & (MEMO_CHUNK - 1)) == 0) {
        if (grow((void **)&vm->memo_chunks, &vm->memo_chunks_cap, vm->memo_nchunks + 1, sizeof(PyObject **)) < 0) {
            return NULL;
        }
        PyObject **chunk = PyMem_Calloc((size_t)MEMO_CHUNK, sizeof(PyObject *));
        if (chunk == NULL) {
            return NULL;
        }
        vm->memo_chunks[vm->memo_nchunks++] = chunk;
        memo_forget_old(vm);
    }
    PyObject **slot = &vm->memo_chunks[vm->memo_nchunks - 1][vm->memo_len & (MEMO_CHUNK - 1)];
    vm->memo_len++;
    return slot;
}

static int memo_put(VM *vm, Py_ssize_t index) {
    if (vm->len <= fence(vm) || index < 0 || index > vm->memo_len) {
        return -1;
    }
    Item *top = &vm->stack[vm->len - 1];
    PyObject *value;
    if (top->kind == K_INT) {
        PyObject *obj = PyLong_FromLongLong(top->val);
        if (obj == NULL) {
            return -1;
        }
        top->kind = K_OBJ;
        top->obj = obj;
    }
    switch (top->kind) {
    case K_OBJ:
        Py_INCREF(top->obj);
        value = top->obj;
        break;
    case K_FRAMES:
        value = MEMO_MAKE(M_PENDING, top->val);
        vm->builders[top->aux].memo_index = index;
        break;
    case K_FRAMESREF:
        value = MEMO_MAKE(M_DONE, top->val);
        break;
    default:
        value = MEMO_MAKE(M_OPAQUE, 0);
    }
    PyObject **slot = index == vm->memo_len ? memo_append(vm) : memo_slot(vm, (uint64_t)index);
    if (slot == NULL) {
        if (MEMO_TAG(value) == 0) {
            Py_DECREF(value);
        }
        return -1;
    }
    PyObject *old = *slot;
    *slot = value;
    if (old != NULL && MEMO_TAG(old) == 0) {
        Py_DECREF(old);
    }
    return 0;
}

static int memo_get(VM *vm, uint64_t index) {
    PyObject **slot = memo_slot(vm, index);
    PyObject *m = slot != NULL ? *slot : NULL;
    if (m == NULL) {
        return -1;
    }
    if (MEMO_TAG(m) == 0) {
        if (m == vm->root) {
            return -1; /* the root inside itself would show the stand-in for device_traces */
        }
        Py_INCREF(m);
        return push_obj(vm, m);
    }
    if (MEMO_TAG(m) == M_DONE) {
        return push4(vm, NULL, MEMO_VAL(m), K_FRAMESREF, 0);
    }
    return -1; /* an object that exists only as columns, or a frames list not finished */
}

/* ---------- new containers, in their context ---------- */

/* the container a value pushed now would go into: the one on top (a single APPEND/SETITEM), or
   the one below the topmost mark (a batch); kind K_* or -1 */
static int below_mark_kind(VM *vm, Py_ssize_t *where) {
    if (vm->nmarks == 0) {
        return -1;
    }
    Py_ssize_t m = vm->marks[vm->nmarks - 1];
    if (m < 1 || m > vm->len) {
        return -1;
    }
    *where = m - 1;
    return vm->stack[m - 1].kind;
}

static int new_list(VM *vm) {
    Py_ssize_t w;
    Item *top = vm->len ? &vm->stack[vm->len - 1] : NULL;
    if (top != NULL && top->kind == K_OBJ && PyUnicode_CheckExact(top->obj)) {
        /* a dict's value: key on top, the dict below it or below the mark */
        Py_ssize_t dict_at = vm->len - 2;
        if (vm->nmarks && vm->marks[vm->nmarks - 1] < vm->len && (vm->len - vm->marks[vm->nmarks - 1]) % 2 == 1) {
            dict_at = vm->marks[vm->nmarks - 1] - 1;
        }
        if (dict_at >= 0) {
            Item *dict = &vm->stack[dict_at];
            if (!vm->devices_made && dict_at == 0 && dict->kind == K_OBJ && dict->obj == vm->root &&
                is_ascii(top->obj, "device_traces")) {
                vm->devices_made = 1;
                return push4(vm, NULL, 0, K_DEVICES, 0);
            }
            if (dict->kind == K_ENTRY && is_ascii(top->obj, "frames")) {
                for (int b = 0; b < N_BUILDERS; b++) {
                    if (!vm->builders[b].in_use) {
                        vm->builders[b].in_use = 1;
                        vm->builders[b].n = 0;
                        vm->builders[b].memo_index = -1;
                        vm->builders[b].generation = ++vm->generations;
                        return push4(vm, NULL, vm->generations, K_FRAMES, b);
                    }
                }
                return -1;
            }
        }
    }
    if (top != NULL && (top->kind == K_DEVICES ||
                        (top->kind == K_TRACE && below_mark_kind(vm, &w) == K_DEVICES && w < vm->len - 1))) {
        Device *d = new_device(vm);
        if (d == NULL) {
            return -1;
        }
        return push4(vm, NULL, 0, K_TRACE, (int32_t)(vm->n_devices - 1));
    }
    return push_obj(vm, PyList_New(0));
}

static int new_dict(VM *vm) {
    Py_ssize_t w;
    if (vm->len == 0 && vm->root == NULL) {
        PyObject *root = PyDict_New();
        vm->root = root;
        return push_obj(vm, root);
    }
    Item *top = vm->len ? &vm->stack[vm->len - 1] : NULL;
    Item *trace = NULL;
    if (top != NULL && top->kind == K_TRACE) {
        trace = top;
    } else if (top != NULL && top->kind == K_ENTRY && below_mark_kind(vm, &w) == K_TRACE && w < vm->len - 1) {
        trace = &vm->stack[w];
    }
    if (trace != NULL) {
        Device *d = &vm->devices[trace->aux];
        Py_ssize_t r = new_row(d);
        if (r < 0) {
            return -1;
        }
        return push4(vm, NULL, r, K_ENTRY, trace->aux);
    }
    return push_obj(vm, PyDict_New());
}

/* ---------- the opcodes ---------- */

static inline uint64_t read_le(const unsigned char *s, int n) {
#if PY_LITTLE_ENDIAN
    if (n == 4) {
        uint32_t v32;
        memcpy(&v32, s, 4);
        return v32;
    }
#endif
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) {
        v = (v << 8) | s[i];
    }
    return v;
}

static int push_int(VM *vm, int64_t v) {
    return push4(vm, NULL, v, K_INT, 0);
}

static int load_long1(VM *vm, const unsigned char *s, int n) {
    if (n == 0) {
        return push_int(vm, 0);
    }
    if (n <= 8) {
        uint64_t v = read_le(s, n);
        if (n < 8 && (s[n - 1] & 0x80)) {
            v |= ~(uint64_t)0 << (8 * n);
        }
        return push_int(vm, (int64_t)v);
    }
    if (n == 9 && s[8] == 0) {
        return push_obj(vm, PyLong_FromUnsignedLongLong(read_le(s, 8)));
    }
    return -1; /* beyond what a snapshot holds: the Python path reads it */
}

static int load_str(VM *vm, uint64_t size) {
    if (size > (uint64_t)(vm->end - vm->p)) {
        return -1;
    }
    PyObject *s = PyUnicode_DecodeUTF8(vm->p, (Py_ssize_t)size, "surrogatepass");
    vm->p += size;
    return push_obj(vm, s);
}

#define RELEASE_STEP (32 << 20)

/* A mapped file's pages already read are given back (they are never read again), so the
   file does not stay in the process's memory; only for a mapping (``release``). */
static void release_pages(VM *vm) {
#if (defined(__unix__) || defined(__APPLE__)) && defined(MADV_DONTNEED)
    if (!vm->release || vm->p - vm->released < RELEASE_STEP) {
        return;
    }
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t from = (uintptr_t)vm->released, to = ((uintptr_t)vm->p & ~(page - 1)) - page;
    if (page > 0 && (from & (page - 1)) == 0 && to > from) {
        madvise((void *)from, to - from, MADV_DONTNEED);
        vm->released = (const char *)to;
    }
#else
    (void)vm;
#endif
}

#define PROGRESS_STEP (16 << 20)

/* Tell ``on_progress`` how far into the buffer the reader is (at most every PROGRESS_STEP
   bytes). A progress display must never stop the reading: whatever it raises is dropped. */
static void report_progress(VM *vm) {
    if (vm->on_progress == NULL || vm->p - vm->reported < PROGRESS_STEP) {
        return;
    }
    vm->reported = vm->p;
    PyObject *r = PyObject_CallFunction(vm->on_progress, "n", (Py_ssize_t)(vm->p - vm->start));
    if (r == NULL) {
        PyErr_Clear();
    } else {
        Py_DECREF(r);
    }
}

#define NEED(n)                                                                                                       \
    if (vm->end - vm->p < (Py_ssize_t)(n)) return -1;

/* At a MARK over a frames list being built: the usual batch (MARK, memo references to frame
   objects, APPENDS) goes straight into the list, which is what running those opcodes one by
   one does. 1: done, up to and with the APPENDS; 0: not such a batch (nothing consumed, run
   the opcodes one by one); -1: failure. */
static int frames_batch(VM *vm) {
    Builder *b = &vm->builders[vm->stack[vm->len - 1].aux];
    const unsigned char *q = (const unsigned char *)vm->p, *end = (const unsigned char *)vm->end;
    Py_ssize_t first = b->n;
    for (;;) {
        uint64_t index;
        int width;
        if (end - q >= 2 && q[0] == 'h') {
            index = q[1];
            width = 2;
        } else if (end - q >= 5 && q[0] == 'j') {
            index = read_le(q + 1, 4);
            width = 5;
        } else {
            break;
        }
        PyObject **slot = memo_slot(vm, index);
        PyObject *m = slot != NULL ? *slot : NULL;
        if (m == NULL || MEMO_TAG(m) != 0 || m == vm->root) {
            break; /* q stays on it: run one by one, they give up there or do something else */
        }
        if (grow((void **)&b->items, &b->cap, b->n + 1, sizeof(PyObject *)) < 0) {
            return -1;
        }
        Py_INCREF(m);
        b->items[b->n++] = m;
        q += width;
    }
    if (q < end && q[0] == 'e' && b->n > first) {
        vm->p = (const char *)q + 1;
        return 1;
    }
    while (b->n > first) {
        Py_DECREF(b->items[--b->n]);
    }
    return 0;
}

/* run the opcodes to STOP: 0, or -1 for the Python path */
static int run(VM *vm) {
    for (;;) {
        NEED(1)
        unsigned char op = (unsigned char)*vm->p++;
        const unsigned char *s = (const unsigned char *)vm->p;
        int rc;
        Py_ssize_t x;
        switch (op) {
        case 0x80: /* PROTO */
            NEED(1)
            if (s[0] > 5) {
                return -1;
            }
            vm->p += 1;
            rc = 0;
            break;
        case 0x95: { /* FRAME */
            NEED(8)
            uint64_t n = read_le(s, 8);
            vm->p += 8;
            rc = n > (uint64_t)(vm->end - vm->p) ? -1 : 0;
            release_pages(vm);
            report_progress(vm);
            break;
        }
        case '.': /* STOP */
            if (vm->len != 1 || vm->nmarks != 0 || vm->stack[0].kind != K_OBJ) {
                return -1;
            }
            return 0;
        case '(': /* MARK */
            if (vm->len > fence(vm) && vm->stack[vm->len - 1].kind == K_FRAMES) {
                rc = frames_batch(vm);
                if (rc != 0) {
                    break;
                }
            }
            if (vm->nmarks >= MAX_MARKS ||
                grow((void **)&vm->marks, &vm->marks_cap, vm->nmarks + 1, sizeof(Py_ssize_t)) < 0) {
                return -1;
            }
            vm->marks[vm->nmarks++] = vm->len;
            rc = 0;
            break;
        case '}': /* EMPTY_DICT */
            rc = new_dict(vm);
            break;
        case ']': /* EMPTY_LIST */
            rc = new_list(vm);
            break;
        case ')': /* EMPTY_TUPLE */
            rc = push_obj(vm, PyTuple_New(0));
            break;
        case 't': /* TUPLE */
            x = pop_mark(vm);
            rc = x < 0 ? -1 : make_tuple(vm, x);
            break;
        case 0x85: /* TUPLE1 */
        case 0x86: /* TUPLE2 */
        case 0x87: /* TUPLE3 */
            x = vm->len - (op - 0x84);
            rc = x < 0 ? -1 : make_tuple(vm, x);
            break;
        case 's': /* SETITEM */
            rc = set_items(vm, vm->len - 2);
            break;
        case 'u': /* SETITEMS */
            x = pop_mark(vm);
            rc = x < 0 ? -1 : set_items(vm, x);
            break;
        case 'a': /* APPEND */
            rc = append_items(vm, vm->len - 1);
            break;
        case 'e': /* APPENDS */
            x = pop_mark(vm);
            rc = x < 0 ? -1 : append_items(vm, x);
            break;
        case 0x94: /* MEMOIZE */
            rc = memo_put(vm, vm->memo_len);
            break;
        case 'q': /* BINPUT */
            NEED(1)
            vm->p += 1;
            rc = memo_put(vm, s[0]);
            break;
        case 'r': /* LONG_BINPUT */
            NEED(4)
            vm->p += 4;
            rc = memo_put(vm, (Py_ssize_t)read_le(s, 4));
            break;
        case 'h': /* BINGET */
            NEED(1)
            vm->p += 1;
            rc = memo_get(vm, s[0]);
            break;
        case 'j': /* LONG_BINGET */
            NEED(4)
            vm->p += 4;
            rc = memo_get(vm, read_le(s, 4));
            break;
        case 'J': /* BININT */
            NEED(4)
            vm->p += 4;
            rc = push_int(vm, (int32_t)(uint32_t)read_le(s, 4));
            break;
        case 'K': /* BININT1 */
            NEED(1)
            vm->p += 1;
            rc = push_int(vm, s[0]);
            break;
        case 'M': /* BININT2 */
            NEED(2)
            vm->p += 2;
            rc = push_int(vm, (int64_t)read_le(s, 2));
            break;
        case 0x8a: /* LONG1 */
            NEED(1)
            NEED(1 + s[0])
            vm->p += 1 + s[0];
            rc = load_long1(vm, s + 1, s[0]);
            break;
        case 'G': { /* BINFLOAT: big-endian IEEE 754 */
            NEED(8)
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++) {
                bits = (bits << 8) | s[i];
            }
            double d;
            memcpy(&d, &bits, sizeof d);
            vm->p += 8;
            rc = push_obj(vm, PyFloat_FromDouble(d));
            break;
        }
        case 'N': /* NONE */
            Py_INCREF(Py_None);
            rc = push_obj(vm, Py_None);
            break;
        case 0x88: /* NEWTRUE */
            Py_INCREF(Py_True);
            rc = push_obj(vm, Py_True);
            break;
        case 0x89: /* NEWFALSE */
            Py_INCREF(Py_False);
            rc = push_obj(vm, Py_False);
            break;
        case 0x8c: /* SHORT_BINUNICODE */
            NEED(1)
            vm->p += 1;
            rc = load_str(vm, s[0]);
            break;
        case 'X': /* BINUNICODE */
            NEED(4)
            vm->p += 4;
            rc = load_str(vm, read_le(s, 4));
            break;
        case 0x8d: /* BINUNICODE8 */
            NEED(8)
            vm->p += 8;
            rc = load_str(vm, read_le(s, 8));
            break;
        default:
            return -1; /* GLOBAL, REDUCE, BUILD, PERSID...: the Python path refuses or reads it */
        }
        if (rc < 0) {
            return -1;
        }
    }
}

/* ---------- the end: checks on final contents, and the result ---------- */

static int frame_ok(PyObject *fr, PyObject *k_file, PyObject *k_line, PyObject *k_name) {
    if (PyUnicode_CheckExact(fr)) {
        return 1;
    }
    if (!PyDict_CheckExact(fr)) {
        return 0;
    }
    PyObject *v = PyDict_GetItemWithError(fr, k_file);
    if ((v == NULL && PyErr_Occurred()) || (v != NULL && !PyUnicode_CheckExact(v))) {
        return 0;
    }
    v = PyDict_GetItemWithError(fr, k_name);
    if ((v == NULL && PyErr_Occurred()) || (v != NULL && !PyUnicode_CheckExact(v))) {
        return 0;
    }
    v = PyDict_GetItemWithError(fr, k_line);
    if (v == NULL) {
        return !PyErr_Occurred();
    }
    if (!PyLong_CheckExact(v)) {
        return 0;
    }
    int overflow = 0;
    PyLong_AsLongLongAndOverflow(v, &overflow);
    if (PyErr_Occurred()) {
        return 0;
    }
    if (overflow > 0) { /* C++ frames: a uint64 */
        PyLong_AsUnsignedLongLong(v);
        return !PyErr_Occurred();
    }
    return overflow == 0;
}

/* every frame of every stack and every forward_frames list as the Python path accepts them */
static int final_checks(VM *vm) {
    PyObject *k_file = PyUnicode_InternFromString("filename");
    PyObject *k_line = PyUnicode_InternFromString("line");
    PyObject *k_name = PyUnicode_InternFromString("name");
    int ok = k_file && k_line && k_name;
    for (Py_ssize_t i = 1; ok && i < PyList_GET_SIZE(vm->stacks); i++) {
        PyObject *t = PyList_GET_ITEM(vm->stacks, i);
        for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(t); j++) {
            ok = frame_ok(PyTuple_GET_ITEM(t, j), k_file, k_line, k_name);
        }
    }
    Py_ssize_t pos = 0;
    PyObject *id, *lst;
    while (ok && PyDict_Next(vm->forward_lists, &pos, &id, &lst)) { /* each distinct list once */
        for (Py_ssize_t j = 0; ok && j < PyList_GET_SIZE(lst); j++) {
            ok = PyUnicode_CheckExact(PyList_GET_ITEM(lst, j));
        }
    }
    Py_XDECREF(k_file);
    Py_XDECREF(k_line);
    Py_XDECREF(k_name);
    return ok ? 0 : -1;
}

static PyObject *column(void **buf, Py_ssize_t n, size_t width) {
    PyObject *b = PyByteArray_FromStringAndSize(*buf ? (const char *)*buf : "", (Py_ssize_t)(n * (Py_ssize_t)width));
    PyMem_Free(*buf);
    *buf = NULL;
    return b;
}

/* a sparse column's rows renumbered from the window's first (d->base): a new reference */
static PyObject *renumbered(PyObject *dict, Py_ssize_t base) {
    if (base == 0 || PyDict_GET_SIZE(dict) == 0) {
        Py_INCREF(dict);
        return dict;
    }
    PyObject *fresh = PyDict_New();
    Py_ssize_t pos = 0;
    PyObject *row, *value;
    while (fresh != NULL && PyDict_Next(dict, &pos, &row, &value)) {
        Py_ssize_t r = PyLong_AsSsize_t(row);
        PyObject *key = (r == -1 && PyErr_Occurred()) ? NULL : PyLong_FromSsize_t(r - base);
        if (key == NULL || (r >= base && PyDict_SetItem(fresh, key, value) < 0)) {
            Py_XDECREF(key);
            Py_CLEAR(fresh);
            break;
        }
        Py_DECREF(key);
    }
    return fresh;
}

static PyObject *device_result(Device *d) {
    if (d->keep > 0 && drop_front(d) < 0) { /* the window's last cut: `keep` rows left (every row is appended) */
        return NULL;
    }
    Py_ssize_t n = d->n - d->base;
    PyObject *forward = renumbered(d->forward, d->base);
    PyObject *pools = renumbered(d->pools, d->base);
    PyObject *contexts = renumbered(d->contexts, d->base);
    if (forward == NULL || pools == NULL || contexts == NULL) {
        Py_XDECREF(forward);
        Py_XDECREF(pools);
        Py_XDECREF(contexts);
        return NULL;
    }
    return Py_BuildValue("(nNONNNNNNONNiNNn)", n, column((void **)&d->action, n, 2), d->action_names,
                         column((void **)&d->size, n, 8), column((void **)&d->addr, n, 8),
                         column((void **)&d->stream, n, 8), column((void **)&d->time, n, 8),
                         column((void **)&d->free, n, 8), column((void **)&d->meta, n, 4), d->meta_names,
                         column((void **)&d->stack, n, 8), forward, d->hints, pools, contexts, d->base);
}

static PyObject *result(VM *vm) {
    PyObject *root = vm->stack[0].obj;
    if (!vm->devices_set) {
        return Py_BuildValue("(OO)", root, Py_None);
    }
    if (vm->devices_appended != vm->n_devices || final_checks(vm) < 0) {
        return NULL;
    }
    PyObject *devices = PyTuple_New(vm->n_devices);
    if (devices == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < vm->n_devices; i++) {
        PyObject *d = device_result(&vm->devices[i]);
        if (d == NULL) {
            Py_DECREF(devices);
            return NULL;
        }
        PyTuple_SET_ITEM(devices, i, d);
    }
    return Py_BuildValue("(O(NO))", root, devices, vm->stacks);
}

static void vm_free(VM *vm) {
    pop_to(vm, 0);
    PyMem_Free(vm->stack);
    PyMem_Free(vm->marks);
    for (Py_ssize_t c = 0; c < vm->memo_nchunks; c++) {
        PyObject **chunk = vm->memo_chunks[c];
        for (Py_ssize_t i = 0; chunk != NULL && i < MEMO_CHUNK && c * MEMO_CHUNK + i < vm->memo_len; i++) {
            if (chunk[i] != NULL && MEMO_TAG(chunk[i]) == 0) {
                Py_DECREF(chunk[i]);
            }
        }
        PyMem_Free(chunk);
    }
    PyMem_Free(vm->memo_chunks);
    for (Py_ssize_t i = 0; i < vm->n_devices; i++) {
        free_device(&vm->devices[i]);
    }
    PyMem_Free(vm->devices);
    for (int b = 0; b < N_BUILDERS; b++) {
        for (Py_ssize_t k = 0; k < vm->builders[b].n; k++) {
            Py_DECREF(vm->builders[b].items[k]);
        }
        PyMem_Free(vm->builders[b].items);
    }
    Py_XDECREF(vm->stacks);
    PyMem_Free(vm->slots);
    Py_XDECREF(vm->used_lists);
    Py_XDECREF(vm->forward_lists);
    for (int i = 0; i < KEY_CACHE; i++) {
        Py_XDECREF(vm->key_objs[i]);
    }
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *oom_name;
    int release = 0;
    PyObject *on_progress = Py_None;
    Py_ssize_t keep = 0;
    if (!PyArg_ParseTuple(args, "y*U|pOn", &buf, &oom_name, &release, &on_progress, &keep)) {
        return NULL;
    }
    if (keep < 0) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "keep must be 0 (every entry) or more");
        return NULL;
    }
    if (keep > PY_SSIZE_T_MAX / 4) { /* more entries than any buffer holds: every entry (and no overflow below) */
        keep = 0;
    }
    VM *vm = PyMem_Calloc(1, sizeof(VM));
    if (vm == NULL) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    vm->p = vm->start = vm->released = buf.buf;
    vm->end = (const char *)buf.buf + buf.len;
    vm->release = release;
    vm->on_progress = on_progress == Py_None ? NULL : on_progress;
    vm->reported = vm->start;
    vm->oom_name = oom_name;
    vm->keep = keep;
    vm->stacks = PyList_New(0);
    vm->used_lists = PyDict_New();
    vm->forward_lists = PyDict_New();
    vm->slots = PyMem_Malloc(64 * sizeof(StackSlot));
    PyObject *out = NULL;
    if (vm->stacks && vm->used_lists && vm->forward_lists && vm->slots) {
        vm->slots_mask = 63;
        for (int i = 0; i < 64; i++) {
            vm->slots[i].key = -1;
        }
        PyObject *empty = PyTuple_New(0);
        if (empty != NULL && PyList_Append(vm->stacks, empty) == 0 && run(vm) == 0) {
            out = result(vm);
        }
        Py_XDECREF(empty);
    }
    vm_free(vm);
    PyMem_Free(vm);
    PyBuffer_Release(&buf);
    if (out == NULL) {
        PyErr_Clear(); /* MemoryError included: the Python path decides */
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(buffer, oom_name, release=False, on_progress=None, keep=0): (root, None | (devices, stacks)), or None "
     "for the Python path. release: the buffer is a read-only file mapping whose pages may be given back once read; "
     "on_progress(offset): called as the reading moves on (every 16 MiB of pickle frames); keep: each device's "
     "columns hold its last `keep` entries only (0: every entry)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode", NULL, -1, methods};

PyMODINIT_FUNC PyInit__decode(void) { return PyModule_Create(&module); }
