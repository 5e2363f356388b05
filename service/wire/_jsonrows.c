/* The rows of integers of a /logprobs JSON body, read natively: jsonrows.py's fast path.

   int_rows(buffer, start, end) reads buffer[start:end] as a JSON array of non-empty arrays of
   unsigned decimal integers (JSON whitespace between tokens, none inside a number; no leading zero;
   at most 18 digits, so every value is below 10^18 and fits int64) and returns (values, counts): two
   bytearrays of native int64, every value in order and each row's length. Anything else, trailing
   whitespace aside, gives None (jsonrows.py then hands the body to the full parser). One pass, the GIL
   released during it; the limited API (abi3), so one build serves every CPython from 3.11. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MAX_DIGITS 18

static int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static const unsigned char *skip(const unsigned char *p, const unsigned char *end) {
    while (p < end && is_space(*p)) p++;
    return p;
}

/* One row `[n, n, ...]` at p (whitespace skipped before it): its values appended to values[*count...].
   Returns the byte after its `]`, or NULL where it is not one. */
static const unsigned char *read_row(const unsigned char *p, const unsigned char *end, int64_t *values,
                                     Py_ssize_t *count) {
    if (p >= end || *p != '[') return NULL;
    p++;
    for (;;) {
        p = skip(p, end);
        const unsigned char *digits = p;
        uint64_t x = 0;
        while (p < end && *p >= '0' && *p <= '9') x = x * 10 + (uint64_t)(*p++ - '0');
        Py_ssize_t n = p - digits;
        if (n == 0 || n > MAX_DIGITS || (n > 1 && *digits == '0')) return NULL;
        values[(*count)++] = (int64_t)x;
        p = skip(p, end);
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        return (p < end && *p == ']') ? p + 1 : NULL;
    }
}

/* The whole array of rows; 1 when it is one, nothing but whitespace after it. */
static int read_rows(const unsigned char *p, const unsigned char *end, int64_t *values, Py_ssize_t *n_values,
                     int64_t *counts, Py_ssize_t *n_rows) {
    p = skip(p, end);
    if (p >= end || *p != '[') return 0;
    p++;
    for (;;) {
        Py_ssize_t first = *n_values;
        p = read_row(skip(p, end), end, values, n_values);
        if (p == NULL) return 0;
        counts[(*n_rows)++] = *n_values - first;
        p = skip(p, end);
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        return p < end && *p == ']' && skip(p + 1, end) == end;
    }
}

static PyObject *int_rows(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, end;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn:int_rows", &view, &start, &end)) return NULL;
    if (start < 0 || end > view.len || start >= end) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    /* every value takes a digit and a separator, every row a pair of brackets and a digit: buffers for
       the most there can be, shrunk after the pass (pages never written are never committed) */
    Py_ssize_t most = (end - start) / 2 + 1;
    PyObject *values = PyByteArray_FromStringAndSize(NULL, most * (Py_ssize_t)sizeof(int64_t));
    PyObject *counts = values ? PyByteArray_FromStringAndSize(NULL, most * (Py_ssize_t)sizeof(int64_t)) : NULL;
    if (counts == NULL) {
        Py_XDECREF(values);
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *text = (const unsigned char *)view.buf;
    int64_t *v = (int64_t *)PyByteArray_AsString(values), *c = (int64_t *)PyByteArray_AsString(counts);
    Py_ssize_t n_values = 0, n_rows = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = read_rows(text + start, text + end, v, &n_values, c, &n_rows);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (ok && PyByteArray_Resize(values, n_values * (Py_ssize_t)sizeof(int64_t)) == 0 &&
        PyByteArray_Resize(counts, n_rows * (Py_ssize_t)sizeof(int64_t)) == 0) {
        return Py_BuildValue("(NN)", values, counts);
    }
    Py_DECREF(values);
    Py_DECREF(counts);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"int_rows", int_rows, METH_VARARGS,
     "int_rows(buffer, start, end) -> (values, counts) | None: buffer[start:end] as rows of int64"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonrows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jsonrows(void) { return PyModule_Create(&module); }
