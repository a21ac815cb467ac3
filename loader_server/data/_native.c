/* The daemon's hot loop in C: write one micro-batch from the mapped corpus into a slot.
 *
 * ArrowDataset keeps, per sample, its length and where its tokens start (a byte address
 * inside the dataset's memory mapping). ``fill`` takes a micro-batch's sample ids and, in
 * one call with the GIL released, writes every field of the slot: token ids and loss mask
 * (padding each row as it goes, or back to back when packed), lengths, sample ids, and for
 * the packed layout position ids and cu_seqlens. This replaces ~60 small numpy operations
 * per micro-batch (one per row and field, plus a memset of the whole slot).
 *
 * Element conversion: the destination is never wider than the source (ids: int32 from
 * int32/uint32/int64; mask: uint8 from any 1-8 byte integer). Values are served exactly or
 * not at all: the copy loop ORs every source element, so an id outside [0, 2^31) or a mask
 * value outside {0, 1} (which a conversion would wrap) raises BadValue naming the sample
 * and position, at the cost of one OR per element in a loop the compiler vectorizes. Two
 * special sources: SRC_BITS (an Arrow bool buffer; addresses are then bit addresses, byte
 * address * 8 + bit) and SRC_ONES (no source column: every real element is 1).
 *
 * Safety: the addresses come from ArrowDataset's own tables over mappings it keeps alive;
 * sample ids are checked against the tables, and every output's size against what the rows
 * need, before anything is written. The copy runs under a SIGBUS guard (loader_server/wire/_guard.h):
 * a corpus file truncated under the daemon raises Fault (an OSError, errno EFAULT) naming
 * the sample, instead of killing the daemon.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../wire/_guard.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

/* Rows start at random places in the corpus: touching row r + PREFETCH_ROWS's first line
 * while row r is copied starts its page walk and cache miss early (902K corpus, pages
 * mapped: 103 -> 72 us per 30-row micro-batch; 20K corpus: 45 -> 43 us). */
#define PREFETCH_ROWS 4
#define SRC_ONES 0
#define SRC_BITS (-1)

/* Copy n elements, converting; returns the OR of every source element (as uint64), from
 * which the caller tells whether some value does not fit the destination exactly. */
#define COPY_OR(DT, ST)                                                                     \
    do {                                                                                    \
        DT *d_ = (DT *)dst;                                                                 \
        const ST *s_ = (const ST *)src;                                                     \
        ST acc_ = 0;                                                                        \
        for (Py_ssize_t j_ = 0; j_ < n; j_++) {                                             \
            ST v_ = s_[j_];                                                                 \
            d_[j_] = (DT)v_;                                                                \
            acc_ |= v_;                                                                     \
        }                                                                                   \
        acc = (uint64_t)acc_;                                                               \
    } while (0)

/* OR of n elements just copied (still in cache): the check costs a pass over L1/L2. */
#define OR_OF(T)                                                                            \
    do {                                                                                    \
        const T *d_ = (const T *)dst;                                                       \
        T acc_ = 0;                                                                         \
        for (Py_ssize_t j_ = 0; j_ < n; j_++) acc_ |= d_[j_];                               \
        acc = (uint64_t)acc_;                                                               \
    } while (0)

static uint64_t copy_elems(char *dst, int dsz, const char *src, int ssz, Py_ssize_t n) {
    uint64_t acc = 0;
    if (dsz == ssz) {  /* libc's memcpy beats any loop here; the OR reads the copy */
        memcpy(dst, src, (size_t)n * (size_t)dsz);
        if (dsz == 1)
            OR_OF(uint8_t);
        else
            OR_OF(uint32_t);
        return acc;
    }
    switch (dsz * 16 + ssz) {
        case 1 * 16 + 2: COPY_OR(uint8_t, uint16_t); break;
        case 1 * 16 + 4: COPY_OR(uint8_t, uint32_t); break;
        case 1 * 16 + 8: COPY_OR(uint8_t, uint64_t); break;
        case 4 * 16 + 8: COPY_OR(uint32_t, uint64_t); break;
        default: break; /* rejected by the caller */
    }
    return acc;
}

/* First element of src (ssz-byte unsigned) with a bit of `bad` set, or -1. */
static Py_ssize_t first_bad(const char *src, int ssz, Py_ssize_t n, uint64_t bad) {
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t v;
        switch (ssz) {
            case 1: v = ((const uint8_t *)src)[j]; break;
            case 2: v = ((const uint16_t *)src)[j]; break;
            case 4: v = ((const uint32_t *)src)[j]; break;
            default: v = ((const uint64_t *)src)[j]; break;
        }
        if (v & bad) return j;
    }
    return -1;
}

static void fill_value(char *dst, int dsz, int64_t value, Py_ssize_t n) {
    if (n <= 0) return;
    switch (dsz) {
        case 1: memset(dst, (int)(uint8_t)value, (size_t)n); break;
        case 2: { uint16_t v = (uint16_t)value, *d = (uint16_t *)dst;
                  for (Py_ssize_t j = 0; j < n; j++) d[j] = v; } break;
        case 4: { uint32_t v = (uint32_t)value, *d = (uint32_t *)dst;
                  for (Py_ssize_t j = 0; j < n; j++) d[j] = v; } break;
        case 8: { uint64_t v = (uint64_t)value, *d = (uint64_t *)dst;
                  for (Py_ssize_t j = 0; j < n; j++) d[j] = v; } break;
    }
}

static void unpack_bits(char *dst, int dsz, int64_t bitaddr, Py_ssize_t n) {
    const uint8_t *base = (const uint8_t *)(uintptr_t)(bitaddr >> 3);
    int64_t b = bitaddr & 7;
    for (Py_ssize_t j = 0; j < n; j++, b++) {
        uint8_t bit = (base[b >> 3] >> (b & 7)) & 1;
        switch (dsz) {
            case 1: ((uint8_t *)dst)[j] = bit; break;
            case 2: ((uint16_t *)dst)[j] = bit; break;
            case 4: ((uint32_t *)dst)[j] = bit; break;
            default: ((uint64_t *)dst)[j] = bit; break;
        }
    }
}

/* A buffer argument: its view, and whether it was acquired (None is allowed for some). */
typedef struct {
    Py_buffer view;
    int held;
} Arg;

static int get_arg(PyObject *obj, Arg *arg, const char *name, Py_ssize_t itemsize, int writable,
                   int optional) {
    arg->held = 0;
    if (obj == Py_None && optional) return 0;
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &arg->view, flags) < 0) return -1;
    arg->held = 1;
    if (arg->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte integers, not %zd-byte items", name,
                     itemsize, arg->view.itemsize);
        return -1;
    }
    return 0;
}

static Py_ssize_t count(Arg *arg) { return arg->held ? arg->view.len / arg->view.itemsize : 0; }

/* One micro-batch's copy, outside the GIL and under a SIGBUS guard (see fill). */
typedef struct {
    const int64_t *samples;
    const int32_t *lengths;
    const int64_t *ids_addr, *mask_addr;
    int ids_kind, mask_kind;
    Py_ssize_t rows, max_len, width;
    long long pad;
    char *ids, *mask;
    int32_t *out_len;
    int64_t *out_sid;
    int32_t *pos, *cu;
    volatile Py_ssize_t row;   /* the row being copied (a fault's sample) */
    const char *bad_column;    /* set when a value cannot be served exactly */
    Py_ssize_t bad_index;
} fill_job;

/* Source bits that make a value unservable: ids must lie in [0, 2^31) (int32 slots), mask
 * values in {0, 1}; sources are read as unsigned, so negative values set high bits. */
#define IDS_BAD(kind) ((kind) == 4 ? (uint64_t)0x80000000u : ~(uint64_t)0x7fffffff)
#define MASK_BAD (~(uint64_t)1)

static void fill_rows(fill_job *job) {
    const int64_t *samples = job->samples, *ids_addr = job->ids_addr, *mask_addr = job->mask_addr;
    const int32_t *lengths = job->lengths;
    int mask_kind = job->mask_kind;
    Py_ssize_t rows = job->rows, width = job->width;
    char *ids = job->ids, *mask = job->mask;
    uint64_t ids_bad = IDS_BAD(job->ids_kind);
    int32_t start = 0;
    if (job->cu) job->cu[0] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t s = samples[r];
        Py_ssize_t n = lengths[s] < job->max_len ? lengths[s] : job->max_len;
        job->row = r;
        if (r + PREFETCH_ROWS < rows) {
            int64_t t = samples[r + PREFETCH_ROWS];
            __builtin_prefetch((const void *)(uintptr_t)ids_addr[t], 0, 0);
            if (mask_kind > 0) __builtin_prefetch((const void *)(uintptr_t)mask_addr[t], 0, 0);
        }
        job->out_len[r] = (int32_t)n;
        job->out_sid[r] = s;
        const char *src = (const char *)(uintptr_t)ids_addr[s];
        if (copy_elems(ids, 4, src, job->ids_kind, n) & ids_bad) {
            job->bad_column = "input_ids";
            job->bad_index = first_bad(src, job->ids_kind, n, ids_bad);
            return;
        }
        if (mask_kind == SRC_ONES) {
            fill_value(mask, 1, 1, n);
        } else if (mask_kind == SRC_BITS) {
            unpack_bits(mask, 1, mask_addr[s], n);
        } else {
            src = (const char *)(uintptr_t)mask_addr[s];
            if (copy_elems(mask, 1, src, mask_kind, n) & MASK_BAD) {
                job->bad_column = "loss_mask";
                job->bad_index = first_bad(src, mask_kind, n, MASK_BAD);
                return;
            }
        }
        if (job->pos)
            for (Py_ssize_t j = 0; j < n; j++) job->pos[start + j] = (int32_t)j;
        start += (int32_t)n;
        if (job->cu) job->cu[r + 1] = start;
        if (width > 0) {
            fill_value(ids + (size_t)n * 4, 4, job->pad, width - n);
            fill_value(mask + n, 1, 0, width - n);
            ids += (size_t)width * 4;
            mask += width;
        } else {
            ids += (size_t)n * 4;
            mask += n;
        }
    }
}

/* fill_rows under the SIGBUS guard: 0, or -1 after a fault (at job->row, address *addr). */
static int fill_guarded(fill_job *job, void **addr) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) {
        *addr = frame.addr;
        return -1;
    }
    fill_rows(job);
    guard_active = NULL;
    return 0;
}

static PyObject *BadValue, *Fault;

/* Fault(EFAULT, text) with .sample: reading the sample's mapped pages raised SIGBUS. */
static void raise_fault(int64_t sample, void *addr) {
    PyObject *text = PyUnicode_FromFormat(
        "reading sample %lld faulted at %p (SIGBUS): its corpus file shrank, or the storage "
        "under it failed", (long long)sample, addr);
    if (text == NULL) return;
    PyObject *exc = PyObject_CallFunction(Fault, "iO", EFAULT, text);
    Py_DECREF(text);
    if (exc == NULL) return;
    PyObject *id = PyLong_FromLongLong((long long)sample);
    if (id != NULL) {
        PyObject_SetAttrString(exc, "sample", id);
        Py_DECREF(id);
    }
    PyErr_SetObject(Fault, exc);
    Py_DECREF(exc);
}

enum { SAMPLES, LENGTHS, IDS_ADDR, MASK_ADDR, OUT_IDS, OUT_MASK, OUT_LENGTHS, OUT_SAMPLES,
       OUT_POSITIONS, OUT_CU, NARGS };

PyDoc_STRVAR(fill_doc,
"fill(sample_ids, lengths, ids_addr, ids_kind, mask_addr, mask_kind, max_len, width, pad,\n"
"     out_ids, out_mask, out_lengths, out_sample_ids, out_positions, out_cu) -> (tokens, maxlen)\n\n"
"Write the micro-batch of sample_ids (int64) into the out_* buffers. Per sample s of the\n"
"dataset: lengths[s] (int32) elements, ids starting at address ids_addr[s] (int64) with\n"
"ids_kind-byte elements, the mask at mask_addr[s] with mask_kind-byte elements (0: no mask,\n"
"all ones, mask_addr None; -1: Arrow bools, bit addresses). Rows are cut to max_len.\n"
"width > 0: padded, row k at element k*width of out_ids (int32) and out_mask (uint8),\n"
"padding pad and 0. width == 0: packed back to back; then out_positions and out_cu\n"
"(int32, or None) get position ids and cu_seqlens. out_lengths (int32) and out_sample_ids\n"
"(int64) get one entry per row. Returns the real tokens written and the longest row.");

static PyObject *fill(PyObject *self, PyObject *args) {
    PyObject *o[NARGS];
    int ids_kind, mask_kind;
    Py_ssize_t max_len, width;
    long long pad;
    if (!PyArg_ParseTuple(args, "OOOiOinnLOOOOOO", &o[SAMPLES], &o[LENGTHS], &o[IDS_ADDR],
                          &ids_kind, &o[MASK_ADDR], &mask_kind, &max_len, &width, &pad,
                          &o[OUT_IDS], &o[OUT_MASK], &o[OUT_LENGTHS], &o[OUT_SAMPLES],
                          &o[OUT_POSITIONS], &o[OUT_CU]))
        return NULL;
    static const char *names[NARGS] = {"sample_ids", "the dataset's lengths", "ids_addr",
                                       "mask_addr", "input_ids", "loss_mask", "lengths",
                                       "the sample_ids output", "position_ids", "cu_seqlens"};
    static const Py_ssize_t sizes[NARGS] = {8, 4, 8, 8, 4, 1, 4, 8, 4, 4};
    static const int writable[NARGS] = {0, 0, 0, 0, 1, 1, 1, 1, 1, 1};
    static const int optional[NARGS] = {0, 0, 0, 1, 0, 0, 0, 0, 1, 1};
    Arg a[NARGS];
    PyObject *result = NULL;
    int k;
    for (k = 0; k < NARGS; k++) a[k].held = 0;
    for (k = 0; k < NARGS; k++)
        if (get_arg(o[k], &a[k], names[k], sizes[k], writable[k], optional[k]) < 0) goto done;

    if (!(ids_kind == 4 || ids_kind == 8)) {
        PyErr_Format(PyExc_ValueError, "ids_kind must be 4 or 8 bytes, got %d", ids_kind);
        goto done;
    }
    if (!(mask_kind == SRC_ONES || mask_kind == SRC_BITS || mask_kind == 1 || mask_kind == 2 ||
          mask_kind == 4 || mask_kind == 8)) {
        PyErr_Format(PyExc_ValueError, "mask_kind %d is not 0, -1, 1, 2, 4 or 8", mask_kind);
        goto done;
    }
    if ((mask_kind != SRC_ONES) != a[MASK_ADDR].held) {
        PyErr_SetString(PyExc_ValueError, "mask_addr must be given exactly when mask_kind != 0");
        goto done;
    }
    if (width < 0 || max_len < 0) {
        PyErr_Format(PyExc_ValueError, "width %zd and max_len %zd must be >= 0", width, max_len);
        goto done;
    }
    Py_ssize_t table = count(&a[LENGTHS]);
    if (count(&a[IDS_ADDR]) != table || (a[MASK_ADDR].held && count(&a[MASK_ADDR]) != table)) {
        PyErr_SetString(PyExc_ValueError, "lengths, ids_addr and mask_addr differ in length");
        goto done;
    }
    const int64_t *samples = (const int64_t *)a[SAMPLES].view.buf;
    const int32_t *lengths = (const int32_t *)a[LENGTHS].view.buf;
    Py_ssize_t rows = count(&a[SAMPLES]), tokens = 0, maxlen = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t s = samples[r];
        if (s < 0 || s >= table) {
            PyErr_Format(PyExc_IndexError, "sample id %lld outside the dataset's %zd samples",
                         (long long)s, table);
            goto done;
        }
        if (lengths[s] < 0) {
            PyErr_Format(PyExc_ValueError, "sample %lld has negative length %d", (long long)s,
                         (int)lengths[s]);
            goto done;
        }
        Py_ssize_t n = lengths[s] < max_len ? lengths[s] : max_len;
        if (width > 0 && n > width) {
            PyErr_Format(PyExc_ValueError, "row %zd has %zd tokens, more than width %zd", r, n,
                         width);
            goto done;
        }
        tokens += n;
        if (n > maxlen) maxlen = n;
    }
    Py_ssize_t need = width > 0 ? rows * width : tokens;
    struct { int arg; Py_ssize_t need; } checks[] = {
        {OUT_IDS, need}, {OUT_MASK, need}, {OUT_LENGTHS, rows}, {OUT_SAMPLES, rows},
        {OUT_POSITIONS, tokens}, {OUT_CU, rows + 1}};
    for (k = 0; k < 6; k++) {
        Arg *b = &a[checks[k].arg];
        if (b->held && count(b) < checks[k].need) {
            PyErr_Format(PyExc_ValueError, "%s holds %zd elements, the micro-batch needs %zd",
                         names[checks[k].arg], count(b), checks[k].need);
            goto done;
        }
    }

    fill_job job = {
        .samples = samples, .lengths = lengths,
        .ids_addr = (const int64_t *)a[IDS_ADDR].view.buf,
        .mask_addr = a[MASK_ADDR].held ? (const int64_t *)a[MASK_ADDR].view.buf : NULL,
        .ids_kind = ids_kind, .mask_kind = mask_kind, .rows = rows, .max_len = max_len,
        .width = width, .pad = pad,
        .ids = (char *)a[OUT_IDS].view.buf, .mask = (char *)a[OUT_MASK].view.buf,
        .out_len = (int32_t *)a[OUT_LENGTHS].view.buf,
        .out_sid = (int64_t *)a[OUT_SAMPLES].view.buf,
        .pos = a[OUT_POSITIONS].held ? (int32_t *)a[OUT_POSITIONS].view.buf : NULL,
        .cu = a[OUT_CU].held ? (int32_t *)a[OUT_CU].view.buf : NULL,
        .row = 0, .bad_column = NULL, .bad_index = 0,
    };
    void *fault_addr = NULL;
    int faulted;
    Py_BEGIN_ALLOW_THREADS
    faulted = fill_guarded(&job, &fault_addr);
    Py_END_ALLOW_THREADS
    if (faulted) {
        raise_fault(samples[job.row], fault_addr);
        goto done;
    }
    if (job.bad_column != NULL) {
        PyObject *args = Py_BuildValue("(Lsn)", (long long)samples[job.row], job.bad_column,
                                       job.bad_index);
        if (args != NULL) {
            PyErr_SetObject(BadValue, args);
            Py_DECREF(args);
        }
        goto done;
    }
    result = Py_BuildValue("nn", tokens, maxlen);
done:
    for (k = 0; k < NARGS; k++)
        if (a[k].held) PyBuffer_Release(&a[k].view);
    return result;
}

/* Map [addr, addr + nbytes) into this process now, one system call for the whole range
 * (a fault per page otherwise, each also mapping 15 neighbours nobody asked for). */
static int populate_advice = MADV_POPULATE_READ;

static void populate_range(uintptr_t addr, size_t nbytes, uintptr_t page, int advice) {
    if (nbytes == 0) return;
    uintptr_t lo = addr & ~(page - 1), hi = (addr + nbytes + page - 1) & ~(page - 1);
    if (madvise((void *)lo, hi - lo, advice) != 0 && errno == EINVAL &&
        advice == MADV_POPULATE_READ) {
        populate_advice = MADV_WILLNEED; /* kernel before 5.14: read-ahead is what remains */
    }
}

PyDoc_STRVAR(populate_doc,
"populate(sample_ids, lengths, ids_addr, ids_kind, mask_addr, mask_kind, max_len, done) -> int\n\n"
"Read (MADV_WILLNEED, all rows at once) and map (MADV_POPULATE_READ) the pages of each\n"
"sample's ids and mask (cut to max_len), skipping samples whose done[s] (uint8) is set,\n"
"and set it.\n"
"Arguments as for fill. The GIL is released. Returns how many samples were populated.");

static PyObject *populate(PyObject *self, PyObject *args) {
    PyObject *o[5];
    int ids_kind, mask_kind;
    Py_ssize_t max_len;
    if (!PyArg_ParseTuple(args, "OOOiOinO", &o[0], &o[1], &o[2], &ids_kind, &o[3], &mask_kind,
                          &max_len, &o[4]))
        return NULL;
    static const char *names[5] = {"sample_ids", "the dataset's lengths", "ids_addr",
                                   "mask_addr", "done"};
    static const Py_ssize_t sizes[5] = {8, 4, 8, 8, 1};
    Arg a[5];
    PyObject *result = NULL;
    int k;
    for (k = 0; k < 5; k++) a[k].held = 0;
    for (k = 0; k < 5; k++)
        if (get_arg(o[k], &a[k], names[k], sizes[k], k == 4, k == 3) < 0) goto done;
    Py_ssize_t table = count(&a[1]);
    if (count(&a[2]) != table || count(&a[4]) != table ||
        (a[3].held && count(&a[3]) != table)) {
        PyErr_SetString(PyExc_ValueError, "lengths, ids_addr, mask_addr and done differ in length");
        goto done;
    }
    const int64_t *samples = (const int64_t *)a[0].view.buf;
    Py_ssize_t rows = count(&a[0]), populated = 0;
    const int32_t *lens = (const int32_t *)a[1].view.buf;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (samples[r] < 0 || samples[r] >= table) {
            PyErr_Format(PyExc_IndexError, "sample id %lld outside the dataset's %zd samples",
                         (long long)samples[r], table);
            goto done;
        }
        if (lens[samples[r]] < 0) {
            PyErr_Format(PyExc_ValueError, "sample %lld has negative length %d",
                         (long long)samples[r], (int)lens[samples[r]]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    const int32_t *lengths = (const int32_t *)a[1].view.buf;
    const int64_t *ids_addr = (const int64_t *)a[2].view.buf;
    const int64_t *mask_addr = a[3].held ? (const int64_t *)a[3].view.buf : NULL;
    uint8_t *seen = (uint8_t *)a[4].view.buf;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    /* Two passes: MADV_WILLNEED starts the reads of every row at once (pages not in the
     * page cache come from disk in parallel), then MADV_POPULATE_READ maps them. */
    for (int pass = 0; pass < 2; pass++) {
        int advice = pass == 0 ? MADV_WILLNEED : populate_advice;
        for (Py_ssize_t r = 0; r < rows; r++) {
            int64_t s = samples[r];
            if (seen[s]) continue;
            size_t n = (size_t)(lengths[s] < max_len ? lengths[s] : max_len);
            populate_range((uintptr_t)ids_addr[s], n * (size_t)ids_kind, page, advice);
            if (mask_kind == SRC_BITS)
                populate_range((uintptr_t)(mask_addr[s] >> 3), (n + 14) / 8, page, advice);
            else if (mask_kind > 0)
                populate_range((uintptr_t)mask_addr[s], n * (size_t)mask_kind, page, advice);
            if (pass == 1) {
                seen[s] = 1;
                populated++;
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(populated);
done:
    for (k = 0; k < 5; k++)
        if (a[k].held) PyBuffer_Release(&a[k].view);
    return result;
}

static PyMethodDef methods[] = {
    {"fill", fill, METH_VARARGS, fill_doc},
    {"populate", populate, METH_VARARGS, populate_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "loader_server.data._native",
    "Native micro-batch fill for the loader daemon's hot loop.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (guard_install() != 0) return PyErr_SetFromErrno(PyExc_OSError);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    BadValue = PyErr_NewExceptionWithDoc(
        "loader_server.data._native.BadValue",
        "BadValue(sample, column, index): a value that would not be served exactly.",
        PyExc_ValueError, NULL);
    Fault = PyErr_NewExceptionWithDoc(
        "loader_server.data._native.Fault",
        "Fault(errno, text), .sample: a corpus page could not be read (SIGBUS).",
        PyExc_OSError, NULL);
    if (BadValue == NULL || Fault == NULL || PyModule_AddObjectRef(m, "BadValue", BadValue) < 0 ||
        PyModule_AddObjectRef(m, "Fault", Fault) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
