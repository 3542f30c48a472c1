/* The trace entries of one chunk turned into columns in one C pass: the fast path of
 * snapshot_lab/frames/build.py (_TraceColumns.add, _stack_groups).
 *
 * scan_chunk(chunk, action_codes, oom_code) -> tuple | None
 *
 * It reads only objects that the restricted unpickler already built (dicts, lists, str, int);
 * it parses no bytes. Whenever an entry is anything but the regular case (not a dict, an
 * unknown or non-str action, a missing or non-int field, a value out of range, a frames value
 * that is not a list, a comparison that fails), it returns None and the caller converts the
 * chunk with the Python code, which is the reference and which names the entry at fault.
 *
 * Returned: (action int16, size, addr, stream, time_us, device_free int64 columns,
 *            group int64 per entry, last int64 per group, same uint8 per entry), each a
 *            bytearray of native-endian values. Groups are the entries' frames lists keyed
 * by (length, identity of the first frame), numbered in order of first appearance; last is
 * each group's last member; same says whether an entry's list equals its group's last one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MISSING INT64_MIN

typedef struct {
    Py_ssize_t length;
    void *first;
    int64_t group; /* -1: empty slot */
} Slot;

typedef struct {
    Slot *slots;
    size_t mask;
    int64_t count;
} GroupTable;

static int table_init(GroupTable *t, Py_ssize_t n) {
    size_t size = 16;
    while (size < (size_t)n * 2) {
        size <<= 1;
    }
    t->slots = PyMem_Malloc(size * sizeof(Slot));
    if (t->slots == NULL) {
        return -1;
    }
    for (size_t i = 0; i < size; i++) {
        t->slots[i].group = -1;
    }
    t->mask = size - 1;
    t->count = 0;
    return 0;
}

/* The group of (length, first), a new one numbered next if never seen. */
static int64_t table_group(GroupTable *t, Py_ssize_t length, void *first) {
    uint64_t h = (uint64_t)(uintptr_t)first * 0x9E3779B97F4A7C15ULL ^ (uint64_t)length * 0xC2B2AE3D27D4EB4FULL;
    size_t i = (size_t)(h ^ (h >> 29)) & t->mask;
    for (;;) {
        Slot *s = &t->slots[i];
        if (s->group < 0) {
            s->length = length;
            s->first = first;
            s->group = t->count++;
            return s->group;
        }
        if (s->length == length && s->first == first) {
            return s->group;
        }
        i = (i + 1) & t->mask;
    }
}

/* value of an int field: 0 on success, 1 when the chunk needs the Python path */
static int read_int(PyObject *entry, PyObject *key, int required, int64_t fallback, int64_t lo, int64_t *out) {
    PyObject *v = PyDict_GetItemWithError(entry, key); /* borrowed */
    if (v == NULL) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        if (required) {
            return 1;
        }
        *out = fallback;
        return 0;
    }
    if (!PyLong_Check(v)) {
        return 1; /* None, float, str...: the Python path names it */
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow != 0 || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 1;
    }
    if ((int64_t)x < lo) {
        return 1;
    }
    *out = (int64_t)x;
    return 0;
}

typedef struct {
    int16_t *action;
    int64_t *size, *addr, *stream, *time, *free, *group, *last;
    uint8_t *same;
    PyObject **lists; /* borrowed frames list of every entry */
} Columns;

typedef struct {
    PyObject *action, *size, *addr, *stream, *time_us, *device_free, *frames;
} Keys;

static PyObject *empty_list; /* the frames of an entry without any */

/* one entry's columns: 0 done, 1 the Python path */
static int scan_entry(PyObject *entry, Py_ssize_t i, Columns *c, Keys *k, PyObject *codes, long oom, GroupTable *t) {
    if (!PyDict_Check(entry)) {
        return 1;
    }
    PyObject *action = PyDict_GetItemWithError(entry, k->action);
    if (action == NULL || !PyUnicode_CheckExact(action)) {
        PyErr_Clear();
        return 1;
    }
    PyObject *code = PyDict_GetItemWithError(codes, action);
    if (code == NULL) {
        PyErr_Clear();
        return 1; /* an action newer than this snaplab */
    }
    long action_code = PyLong_AsLong(code);
    if (action_code == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    c->action[i] = (int16_t)action_code;
    if (read_int(entry, k->size, 1, 0, 0, &c->size[i]) || read_int(entry, k->addr, 0, MISSING, 0, &c->addr[i]) ||
        read_int(entry, k->stream, 0, 0, INT64_MIN, &c->stream[i]) ||
        read_int(entry, k->time_us, 0, MISSING, 0, &c->time[i])) {
        return 1;
    }
    c->free[i] = MISSING;
    if (action_code == oom) {
        PyObject *v = PyDict_GetItemWithError(entry, k->device_free);
        if (v == NULL && PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        /* check_int's rule: an int, not a bool */
        if (v != NULL && v != Py_None &&
            (!PyLong_CheckExact(v) || read_int(entry, k->device_free, 1, 0, 0, &c->free[i]))) {
            return 1;
        }
    }
    PyObject *frames = PyDict_GetItemWithError(entry, k->frames);
    if (frames == NULL) {
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return 1;
        }
        frames = empty_list;
    }
    if (!PyList_CheckExact(frames)) {
        return 1;
    }
    Py_ssize_t length = PyList_GET_SIZE(frames);
    c->lists[i] = frames;
    c->group[i] = table_group(t, length, length > 0 ? (void *)PyList_GET_ITEM(frames, 0) : NULL);
    return 0;
}

/* each group's last member, and whether every entry's list equals it: 0 done, 1 Python path */
static int compare_groups(Py_ssize_t n, Columns *c) {
    for (Py_ssize_t i = 0; i < n; i++) {
        c->last[c->group[i]] = i;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rep = c->lists[c->last[c->group[i]]];
        PyObject *mine = c->lists[i];
        if (rep == mine) {
            c->same[i] = 1;
            continue;
        }
        /* lists of the same objects compare pointer by pointer; anything else compares by
           value, as Python's `rep == mine` does (frame dicts of str and int) */
        int eq = PyObject_RichCompareBool(rep, mine, Py_EQ);
        if (eq < 0) {
            PyErr_Clear();
            return 1;
        }
        c->same[i] = (uint8_t)eq;
    }
    return 0;
}

static PyObject *column(Py_ssize_t n, size_t width, void **data) {
    PyObject *b = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n * width));
    if (b != NULL) {
        *data = PyByteArray_AS_STRING(b);
    }
    return b;
}

#define N_OUT 9

static PyObject *scan_chunk(PyObject *self, PyObject *args) {
    PyObject *chunk, *codes;
    long oom;
    if (!PyArg_ParseTuple(args, "O!O!l", &PyList_Type, &chunk, &PyDict_Type, &codes, &oom)) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(chunk);
    if (n > (PY_SSIZE_T_MAX / 16)) {
        Py_RETURN_NONE;
    }
    Keys k = {
        PyUnicode_InternFromString("action"), PyUnicode_InternFromString("size"),
        PyUnicode_InternFromString("addr"),   PyUnicode_InternFromString("stream"),
        PyUnicode_InternFromString("time_us"), PyUnicode_InternFromString("device_free"),
        PyUnicode_InternFromString("frames"),
    };
    PyObject *out[N_OUT] = {NULL};
    Columns c;
    GroupTable t = {NULL, 0, 0};
    PyObject *result = NULL;
    c.lists = NULL;
    if (!k.action || !k.size || !k.addr || !k.stream || !k.time_us || !k.device_free || !k.frames) {
        goto done;
    }
    void *data[N_OUT];
    size_t widths[N_OUT] = {2, 8, 8, 8, 8, 8, 8, 8, 1};
    for (int j = 0; j < N_OUT; j++) {
        out[j] = column(n, widths[j], &data[j]);
        if (out[j] == NULL) {
            goto done;
        }
    }
    c.action = data[0];
    c.size = data[1];
    c.addr = data[2];
    c.stream = data[3];
    c.time = data[4];
    c.free = data[5];
    c.group = data[6];
    c.last = data[7];
    c.same = data[8];
    c.lists = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(PyObject *));
    if (c.lists == NULL || table_init(&t, n) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    /* the entries stay alive: the chunk holds them, and nothing here runs Python code that
       could change it (dict lookups by str keys; list comparisons of str/int dicts) */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (scan_entry(PyList_GET_ITEM(chunk, i), i, &c, &k, codes, oom, &t)) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    }
    if (compare_groups(n, &c)) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    if (PyByteArray_Resize(out[7], (Py_ssize_t)(t.count * 8)) < 0) {
        goto done;
    }
    result = PyTuple_New(N_OUT);
    if (result != NULL) {
        for (int j = 0; j < N_OUT; j++) {
            PyTuple_SET_ITEM(result, j, out[j]);
            out[j] = NULL;
        }
    }
done:
    for (int j = 0; j < N_OUT; j++) {
        Py_XDECREF(out[j]);
    }
    PyMem_Free(c.lists);
    PyMem_Free(t.slots);
    Py_XDECREF(k.action);
    Py_XDECREF(k.size);
    Py_XDECREF(k.addr);
    Py_XDECREF(k.stream);
    Py_XDECREF(k.time_us);
    Py_XDECREF(k.device_free);
    Py_XDECREF(k.frames);
    return result;
}

static PyMethodDef methods[] = {
    {"scan_chunk", scan_chunk, METH_VARARGS,
     "scan_chunk(chunk, action_codes, oom_code): the chunk's columns, or None for the Python path."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan", NULL, -1, methods};

PyMODINIT_FUNC PyInit__scan(void) {
    empty_list = PyList_New(0);
    if (empty_list == NULL) {
        return NULL;
    }
    return PyModule_Create(&module);
}
