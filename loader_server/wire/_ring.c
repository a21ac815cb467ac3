/* Sequentially consistent 64-bit loads and stores on a shared-memory ring's counters.
 *
 * The daemon and a client exchange batches through two counters in shared memory
 * (``produced`` in the ring header, ``consumed`` in the client's control page) and two
 * wake thresholds. Each side stores its counter, then loads the other side's threshold;
 * with sequentially consistent operations at least one of the two sees the other's write,
 * so a wake-up is never lost (the Dekker pattern), and the stores publish the slot's data
 * written before them on any CPU (x86 or ARM). Python and numpy offer no such operation.
 *
 * A side that has nothing to do sleeps on a futex (the ``bell`` word of the ring header) and
 * the other side rings it: one system call each way, no message, no I/O thread.
 *
 * Every access runs under a SIGBUS guard (_guard.h): a control page truncated by whoever
 * may write it raises OSError(EFAULT) in the process that touches it, instead of killing it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "_guard.h"

/* OSError(EFAULT, ...): the word lies past the end of its (truncated) file. */
static PyObject *fault(void) {
    PyObject *args = Py_BuildValue(
        "(is)", EFAULT, "a shared-memory counter lies past the end of its file (truncated)");
    if (args != NULL) {
        PyErr_SetObject(PyExc_OSError, args);
        Py_DECREF(args);
    }
    return NULL;
}

/* The guarded accesses: 0, or -1 when the word's page lies past the end of its file. */
static int load64(uint64_t *p, uint64_t *out) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) return -1;
    *out = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    guard_active = NULL;
    return 0;
}

static int store64(uint64_t *p, uint64_t value) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) return -1;
    __atomic_store_n(p, value, __ATOMIC_SEQ_CST);
    guard_active = NULL;
    return 0;
}

static int load32(uint32_t *p, uint32_t *out) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) return -1;
    *out = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    guard_active = NULL;
    return 0;
}

static int bump32(uint32_t *p) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) return -1;
    __atomic_add_fetch(p, 1, __ATOMIC_SEQ_CST);
    guard_active = NULL;
    return 0;
}

static uint64_t *word(Py_buffer *view, Py_ssize_t offset) {
    if (offset < 0 || offset % 8 != 0 || offset + 8 > view->len) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned 8-byte word of a %zd-byte buffer",
                     offset, view->len);
        return NULL;
    }
    return (uint64_t *)((char *)view->buf + offset);
}

PyDoc_STRVAR(load_doc, "load(buffer, offset) -> int: atomic (seq_cst) load of a uint64.");

static PyObject *load(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "y*n", &view, &offset)) return NULL;
    uint64_t *p = word(&view, offset);
    uint64_t value = 0;
    int rc = p == NULL ? 1 : load64(p, &value);
    PyBuffer_Release(&view);
    if (rc > 0) return NULL;
    return rc < 0 ? fault() : PyLong_FromUnsignedLongLong(value);
}

PyDoc_STRVAR(store_doc, "store(buffer, offset, value): atomic (seq_cst) store of a uint64.");

static PyObject *store(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    unsigned long long value;
    if (!PyArg_ParseTuple(args, "w*nK", &view, &offset, &value)) return NULL;
    uint64_t *p = word(&view, offset);
    int rc = p == NULL ? 1 : store64(p, (uint64_t)value);
    PyBuffer_Release(&view);
    if (rc > 0) return NULL;
    if (rc < 0) return fault();
    Py_RETURN_NONE;
}

static uint32_t *word32(Py_buffer *view, Py_ssize_t offset) {
    if (offset < 0 || offset % 4 != 0 || offset + 4 > view->len) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not an aligned 4-byte word of a %zd-byte buffer",
                     offset, view->len);
        return NULL;
    }
    return (uint32_t *)((char *)view->buf + offset);
}

PyDoc_STRVAR(bell_doc, "bell(buffer, offset) -> int: atomic load of a uint32 bell (futex word).");

static PyObject *bell(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "y*n", &view, &offset)) return NULL;
    uint32_t *p = word32(&view, offset);
    uint32_t value = 0;
    int rc = p == NULL ? 1 : load32(p, &value);
    PyBuffer_Release(&view);
    if (rc > 0) return NULL;
    return rc < 0 ? fault() : PyLong_FromUnsignedLong(value);
}

PyDoc_STRVAR(wait_doc,
"wait(buffer, offset, seen, timeout_s) -> bool\n\n"
"Sleep until the bell at offset differs from seen (True) or timeout_s passes (False).\n"
"The buffer may be a read-only shared mapping; the GIL is released while sleeping.");

static PyObject *wait(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    unsigned int seen;
    double timeout;
    if (!PyArg_ParseTuple(args, "y*nId", &view, &offset, &seen, &timeout)) return NULL;
    uint32_t *p = word32(&view, offset);
    if (p == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (timeout < 0) timeout = 0;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, p, FUTEX_WAIT, seen, &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (rc == 0 || err == EAGAIN) Py_RETURN_TRUE;  /* rung, or rung before we slept */
    if (err == ETIMEDOUT) Py_RETURN_FALSE;
    if (err == EINTR) {
        if (PyErr_CheckSignals() < 0) return NULL;
        Py_RETURN_TRUE;  /* the caller looks again, as after any wake-up */
    }
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

PyDoc_STRVAR(ring_doc, "ring(buffer, offset): advance the bell at offset and wake its sleepers.");

static PyObject *ring(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "w*n", &view, &offset)) return NULL;
    uint32_t *p = word32(&view, offset);
    int rc = p == NULL ? 1 : bump32(p);
    if (rc == 0) syscall(SYS_futex, p, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
    PyBuffer_Release(&view);
    if (rc > 0) return NULL;
    if (rc < 0) return fault();
    Py_RETURN_NONE;
}

/* memcpy of each (dst_offset, src_offset, nbytes) triple, all bounds checked first. */
static int copy_all(char *dst, const char *src, const int64_t *r, Py_ssize_t k) {
    guard_frame frame;
    guard_active = &frame;
    if (sigsetjmp(frame.jump, 0) != 0) return -1;
    for (Py_ssize_t i = 0; i < k; i++) memcpy(dst + r[3 * i], src + r[3 * i + 1], (size_t)r[3 * i + 2]);
    guard_active = NULL;
    return 0;
}

PyDoc_STRVAR(gather_doc,
"gather(dst, src, ranges): copy bytes from src to dst for each (dst_offset, src_offset,\n"
"nbytes) row of ranges (int64, flat), with the GIL released; every range is checked\n"
"against both buffers first. A source page past the end of its file raises OSError.");

static PyObject *gather(PyObject *self, PyObject *args) {
    Py_buffer dst, src, ranges;
    if (!PyArg_ParseTuple(args, "w*y*y*", &dst, &src, &ranges)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = ranges.len / (Py_ssize_t)(3 * sizeof(int64_t));
    const int64_t *r = (const int64_t *)ranges.buf;
    if (ranges.len % (Py_ssize_t)(3 * sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "ranges must hold (dst, src, nbytes) int64 triples");
        goto done;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t d = r[3 * i], s = r[3 * i + 1], n = r[3 * i + 2];
        if (d < 0 || s < 0 || n < 0 || d > dst.len - n || s > src.len - n) {
            PyErr_Format(PyExc_ValueError, "range %zd (%lld, %lld, %lld) lies outside the buffers",
                         i, (long long)d, (long long)s, (long long)n);
            goto done;
        }
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = copy_all((char *)dst.buf, (const char *)src.buf, r, k);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        fault();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&ranges);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"load", load, METH_VARARGS, load_doc},
    {"store", store, METH_VARARGS, store_doc},
    {"bell", bell, METH_VARARGS, bell_doc},
    {"wait", wait, METH_VARARGS, wait_doc},
    {"ring", ring, METH_VARARGS, ring_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "loader_server.wire._ring", "Atomic counters for shared-memory rings.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (guard_install() != 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyModule_Create(&module);
}
