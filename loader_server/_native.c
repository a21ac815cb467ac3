/* The daemon's hot loop in C: gather a micro-batch's rows from the mapped corpus into a slot.
 *
 * Python computes, vectorized, where each row starts (a byte address inside the dataset's
 * memory mapping) and how many elements it has; one call then copies every row of one
 * field into the slot, filling the padding of each row as it goes, with the GIL released.
 * This replaces ~60 small numpy operations per micro-batch (one per row and field, plus a
 * memset of the whole slot) by one pass over the destination.
 *
 * Element conversion: the destination is never wider than the source (ids: int32 from
 * int32/uint32/int64; mask: uint8 from any 1-8 byte integer), so a conversion keeps the
 * low bytes, exactly as numpy's unsafe cast does. Two special sources: SRC_BITS (an Arrow
 * bool buffer; addresses are then bit addresses, byte address * 8 + bit) and SRC_ONES (no
 * source column: every real element is 1).
 *
 * Safety: the addresses come from ArrowDataset's own tables over mappings it keeps alive;
 * the destination's size is checked against what the rows need before anything is written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define SRC_ONES 0
#define SRC_BITS (-1)

#define CONVERT(DT, ST)                                                                     \
    do {                                                                                    \
        DT *d_ = (DT *)dst;                                                                 \
        const ST *s_ = (const ST *)src;                                                     \
        for (Py_ssize_t j_ = 0; j_ < n; j_++) d_[j_] = (DT)s_[j_];                          \
    } while (0)

static void copy_elems(char *dst, int dsz, const char *src, int ssz, Py_ssize_t n) {
    if (dsz == ssz) {
        memcpy(dst, src, (size_t)n * (size_t)dsz);
        return;
    }
    switch (dsz * 16 + ssz) {
        case 1 * 16 + 2: CONVERT(uint8_t, uint16_t); break;
        case 1 * 16 + 4: CONVERT(uint8_t, uint32_t); break;
        case 1 * 16 + 8: CONVERT(uint8_t, uint64_t); break;
        case 2 * 16 + 4: CONVERT(uint16_t, uint32_t); break;
        case 2 * 16 + 8: CONVERT(uint16_t, uint64_t); break;
        case 4 * 16 + 8: CONVERT(uint32_t, uint64_t); break;
        default: break; /* rejected by the caller */
    }
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

static int int64_vector(Py_buffer *view, const char *what) {
    if (view->itemsize != 8 || view->ndim != 1 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0 &&
         strcmp(view->format, "=q") != 0 && strcmp(view->format, "=l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D int64 array", what);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gather_doc,
"gather(dst, dst_itemsize, width, pad, addrs, lens, src_kind) -> int\n\n"
"Copy row k (lens[k] elements starting at address addrs[k]) into dst.\n"
"width > 0: padded, row k at element k*width, elements lens[k]..width-1 set to pad.\n"
"width == 0: packed, rows back to back, no padding.\n"
"src_kind: source element size in bytes (1, 2, 4 or 8, not narrower than dst_itemsize),\n"
"0 (every element is 1, addrs unused) or -1 (Arrow bit-packed bools, addrs are bit\n"
"addresses). Returns the number of real elements written.");

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *d_obj, *a_obj, *l_obj;
    Py_buffer dst, addrs, lens;
    int dsz, skind;
    Py_ssize_t width;
    long long pad;
    if (!PyArg_ParseTuple(args, "OinLOOi", &d_obj, &dsz, &width, &pad, &a_obj, &l_obj, &skind))
        return NULL;
    if (PyObject_GetBuffer(d_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(a_obj, &addrs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (PyObject_GetBuffer(l_obj, &lens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&addrs);
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (int64_vector(&addrs, "addrs") < 0 || int64_vector(&lens, "lens") < 0) goto done;
    if (dsz != 1 && dsz != 2 && dsz != 4 && dsz != 8) {
        PyErr_Format(PyExc_ValueError, "dst_itemsize must be 1, 2, 4 or 8, got %d", dsz);
        goto done;
    }
    if (!(skind == SRC_ONES || skind == SRC_BITS ||
          ((skind == 1 || skind == 2 || skind == 4 || skind == 8) && skind >= dsz))) {
        PyErr_Format(PyExc_ValueError,
                     "src_kind %d cannot be converted to %d-byte elements", skind, dsz);
        goto done;
    }
    if (width < 0) {
        PyErr_Format(PyExc_ValueError, "width must be >= 0, got %zd", width);
        goto done;
    }
    Py_ssize_t rows = lens.len / 8;
    if (addrs.len / 8 != rows) {
        PyErr_Format(PyExc_ValueError, "addrs has %zd entries, lens %zd", addrs.len / 8, rows);
        goto done;
    }
    const int64_t *a = (const int64_t *)addrs.buf, *l = (const int64_t *)lens.buf;
    Py_ssize_t need = 0, total = 0;
    for (Py_ssize_t k = 0; k < rows; k++) {
        if (l[k] < 0 || (width > 0 && l[k] > width)) {
            PyErr_Format(PyExc_ValueError, "row %zd has length %lld, outside [0, %zd]", k,
                         (long long)l[k], width > 0 ? width : PY_SSIZE_T_MAX);
            goto done;
        }
        total += (Py_ssize_t)l[k];
    }
    need = width > 0 ? rows * width : total;
    if (need > dst.len / dsz) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd elements, the rows need %zd",
                     dst.len / dsz, need);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    char *out = (char *)dst.buf;
    for (Py_ssize_t k = 0; k < rows; k++) {
        Py_ssize_t n = (Py_ssize_t)l[k];
        if (skind == SRC_ONES)
            fill_value(out, dsz, 1, n);
        else if (skind == SRC_BITS)
            unpack_bits(out, dsz, a[k], n);
        else
            copy_elems(out, dsz, (const char *)(uintptr_t)a[k], skind, n);
        if (width > 0) {
            fill_value(out + (size_t)n * dsz, dsz, pad, width - n);
            out += (size_t)width * dsz;
        } else {
            out += (size_t)n * dsz;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&lens);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&dst);
    return result;
}

PyDoc_STRVAR(positions_doc,
"positions(dst, lens) -> int\n\n"
"Write 0..lens[k]-1 for each row k back to back into dst (int32): the position ids of a\n"
"packed row. Returns the number of elements written.");

static PyObject *positions(PyObject *self, PyObject *args) {
    PyObject *d_obj, *l_obj;
    if (!PyArg_ParseTuple(args, "OO", &d_obj, &l_obj)) return NULL;
    Py_buffer dst, lens;
    if (PyObject_GetBuffer(d_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(l_obj, &lens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    PyObject *result = NULL;
    if (int64_vector(&lens, "lens") < 0) goto done;
    if (dst.itemsize != 4) {
        PyErr_SetString(PyExc_TypeError, "dst must be an int32 array");
        goto done;
    }
    Py_ssize_t rows = lens.len / 8, total = 0;
    const int64_t *l = (const int64_t *)lens.buf;
    for (Py_ssize_t k = 0; k < rows; k++) {
        if (l[k] < 0) {
            PyErr_Format(PyExc_ValueError, "row %zd has negative length %lld", k, (long long)l[k]);
            goto done;
        }
        total += (Py_ssize_t)l[k];
    }
    if (total > dst.len / 4) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd elements, the rows need %zd",
                     dst.len / 4, total);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    int32_t *out = (int32_t *)dst.buf;
    for (Py_ssize_t k = 0; k < rows; k++)
        for (int64_t j = 0; j < l[k]; j++) *out++ = (int32_t)j;
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(total);
done:
    PyBuffer_Release(&lens);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS, gather_doc},
    {"positions", positions, METH_VARARGS, positions_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "loader_server._native",
    "Native row gather for the loader daemon's hot loop.", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
