/* The big members of a /logprobs JSON body read natively, and the big arrays of an answer written:
   jsonrows.py's fast path and base64rows.py.

   int_rows(buffer, start, end) reads buffer[start:end] as a JSON array of non-empty arrays of
   unsigned decimal integers (JSON whitespace between tokens, none inside a number; no leading zero;
   at most 18 digits, so every value is below 10^18 and fits int64) and returns (values, counts): two
   bytearrays of native int64, every value in order and each row's length.

   route_rows(buffer, start, end) reads buffer[start:end] as `routed_experts`: a JSON array whose
   rows are each null, a string (SGLang's base64 of little-endian int32) or nested lists
   [positions][layers][top_k] of decimal integers within int32 (the same layers and top_k at every
   position of the row; none empty). It returns (values, rows, itemsize): every row's ids in order,
   decoded straight from the body, as u1 when every id of the field is in 0 .. 255 (itemsize 1),
   else as little-endian int32 (itemsize 4); and per row five int64 (kind, a, b, layers, top_k):
   kind 0 null; 1 base64, ids a .. a+b-1 of values; 2 a string left for Python to judge (not
   canonical base64, or not a whole number of int32), bytes a .. b-1 of buffer; 3 lists, ids
   a .. a+b-1 of values in [b / (layers top_k), layers, top_k] (an empty row: b = 0). Canonical
   base64: the standard alphabet, a multiple of 4 characters, at most two `=` at the end (the bits
   they leave over ignored, as CPython's b64decode does).

   Either reader gives None for anything else, trailing whitespace aside (jsonrows.py then hands the
   body to the full parser). One pass, the GIL released during it.

   members(buffer) finds the top-level members of the JSON object in buffer (whitespace around it):
   per member five int64 (start, key start, key end, value, end), buffer[start:end] the member between
   its separators (the `{` or `,` before it, the `,` or `}` after it), its key plain (no escape).
   Values are skipped by their brackets and strings alone: each member's reader judges its own.

   b64_strings(blocks, itemsize) writes the JSON array ["<base64>", ...] of the blocks (objects with
   the buffer protocol, C-contiguous), each block's bytes base64-encoded (standard alphabet, padded),
   or with itemsize 1 or 2 its unsigned items first widened to little-endian int32. The GIL released.

   int_lists(blocks, itemsize, signed) writes the JSON array of the blocks (C-contiguous arrays of
   native integers of `itemsize` bytes, 1 to 8 dimensions, none empty but the first) each as nested
   lists, as orjson writes a numpy array; the GIL released.

   float_lists(blocks) writes the same of native float32 blocks, each value as orjson writes a numpy
   float32 (_f32json.h: the shortest decimal that reads back, NaN and infinities null); the GIL
   released while it writes, and while it copies the text (written to room for the longest numbers)
   into the bytes of its length.

   prompt_entries(numbers, ids, first_rank, keep, slots, pool, start, length) writes a block of vLLM's
   prompt_logprobs positions (service/http/completions/jsonwriter.py), each `,{entry,...}`, an entry
   `,"<id>":{"logprob":<number>,"rank":<rank>,"decoded_token":<piece>` for every slot kept: the
   numbers are orjson's text of every slot's log-prob, ids and keep [positions * slots] (int64, u1),
   first_rank [positions] (slot j > 0 has rank j), the pieces `pool[start[id] : start[id] +
   length[id]]`. The GIL released; a ValueError where the arrays do not fit together.

   route_faults(ids, itemsize, signed, layers, k, experts, keep) judges routes [positions, layers, k]
   (C-contiguous native u1, u2, i4 or i8; keep: None or one byte a position, 0 where the position is
   not judged) in one pass with the GIL released: (1, i) for the first id in C order outside
   0 .. experts - 1 (i its flat index), else (2, g) for the first (position, layer) group g naming an
   expert twice, else (0, -1). service/normalise/expert_routes.py reads it, as its numpy checks do.

   The limited API (abi3), so one build serves every CPython from 3.11. */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_f32json.h"

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

/* ---- members ---- */

/* the string whose opening quote is at p: the byte after its closing quote, or NULL */
static const unsigned char *skip_string(const unsigned char *p, const unsigned char *end) {
    for (p++;;) {
        const unsigned char *q = memchr(p, '"', (size_t)(end - p));
        if (q == NULL) return NULL;
        const unsigned char *b = q;
        while (b > p && b[-1] == '\\') b--;
        if ((q - b) % 2 == 0) return q + 1; /* not escaped */
        p = q + 1;
    }
}

/* the value at p (its first byte): the byte after it, or NULL. Arrays and objects are skipped by
   their brackets alone (strings inside skipped whole); the member's reader or pydantic judges it. */
static const unsigned char *skip_value(const unsigned char *p, const unsigned char *end) {
    if (p >= end) return NULL;
    if (*p == '"') return skip_string(p, end);
    if (*p == '[' || *p == '{') {
        Py_ssize_t depth = 0;
        while (p < end) {
            unsigned char c = *p;
            if (c == '"') {
                p = skip_string(p, end);
                if (p == NULL) return NULL;
                continue;
            }
            if (c == '[' || c == '{') depth++;
            if (c == ']' || c == '}') depth--;
            p++;
            if (depth == 0) return p;
        }
        return NULL;
    }
    const unsigned char *first = p;
    while (p < end && *p != ',' && *p != '}' && *p != ']' && !is_space(*p)) p++;
    return p > first ? p : NULL;
}

/* The top-level members of the object buffer[0:len] (whitespace around it): per member five int64,
   (start, key start, key end, value, end): raw[start:end] is the member between its separators,
   its key plain (no escape). 0 where it is not plainly an object of such members. */
static int read_members(const unsigned char *base, Py_ssize_t len, int64_t **out, Py_ssize_t *n, Py_ssize_t *room) {
    const unsigned char *end = base + len, *p = skip(base, end);
    if (p >= end || *p != '{') return 0;
    const unsigned char *sep = p;
    p = skip(p + 1, end);
    if (p < end && *p == '}') return skip(p + 1, end) == end;
    for (;;) {
        if (p >= end || *p != '"') return 0;
        const unsigned char *key = p + 1, *close = memchr(key, '"', (size_t)(end - key));
        if (close == NULL || memchr(key, '\\', (size_t)(close - key)) != NULL) return 0;
        p = skip(close + 1, end);
        if (p >= end || *p != ':') return 0;
        const unsigned char *value = skip(p + 1, end);
        p = skip_value(value, end);
        if (p == NULL) return 0;
        p = skip(p, end);
        if (p >= end || (*p != ',' && *p != '}')) return 0;
        if (*n == *room) {
            Py_ssize_t more = *room ? 2 * *room : 32;
            int64_t *grown = realloc(*out, (size_t)more * 5 * sizeof(int64_t));
            if (grown == NULL) return -1;
            *out = grown;
            *room = more;
        }
        int64_t *m = *out + 5 * (*n)++;
        m[0] = sep + 1 - base;
        m[1] = key - base;
        m[2] = close - base;
        m[3] = value - base;
        m[4] = p - base;
        if (*p == '}') return skip(p + 1, end) == end;
        sep = p;
        p = skip(p + 1, end);
    }
}

static PyObject *members(PyObject *self, PyObject *args) {
    Py_buffer view;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*:members", &view)) return NULL;
    int64_t *found = NULL;
    Py_ssize_t n = 0, room = 0;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = read_members((const unsigned char *)view.buf, view.len, &found, &n, &room);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyObject *out = NULL;
    if (ok < 0) {
        PyErr_NoMemory();
    } else if (ok) {
        out = PyBytes_FromStringAndSize((const char *)found, n * 5 * (Py_ssize_t)sizeof(int64_t));
    } else {
        out = Py_None;
        Py_INCREF(out);
    }
    free(found);
    return out;
}

/* ---- base64 (the standard alphabet) ---- */

static const char ALPHABET[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
#define BAD 0x01000000u
/* a character's 6 bits in place for each of a quad's four characters; BAD where it is not base64 */
static uint32_t D0[256], D1[256], D2[256], D3[256];
/* every 12 bits -> their two characters */
static char PAIRS[4096][2];

static void build_tables(void) {
    for (int c = 0; c < 256; c++) D0[c] = D1[c] = D2[c] = D3[c] = BAD;
    for (uint32_t v = 0; v < 64; v++) {
        unsigned char c = (unsigned char)ALPHABET[v];
        D0[c] = v << 18;
        D1[c] = v << 12;
        D2[c] = v << 6;
        D3[c] = v;
    }
    for (int x = 0; x < 4096; x++) {
        PAIRS[x][0] = ALPHABET[x >> 6];
        PAIRS[x][1] = ALPHABET[x & 63];
    }
}

/* `quads` full quads of s into out, 3 bytes each; 0 where a character is not base64 */
static int decode_quads(const unsigned char *s, Py_ssize_t quads, unsigned char *out) {
    uint32_t seen = 0;
    for (Py_ssize_t q = 0; q < quads; q++, s += 4, out += 3) {
        uint32_t v = D0[s[0]] | D1[s[1]] | D2[s[2]] | D3[s[3]];
        seen |= v;
        out[0] = (unsigned char)(v >> 16);
        out[1] = (unsigned char)(v >> 8);
        out[2] = (unsigned char)v;
    }
    return !(seen & BAD);
}

/* ---- route_rows ---- */

enum { KIND_NULL = 0, KIND_BASE64 = 1, KIND_STRING = 2, KIND_LISTS = 3 };
enum { DECLINE = 0, OK = 1, WIDE = 2, NO_MEMORY = 3 };

typedef struct {
    unsigned char *values; /* ids so far: u1, or little-endian int32 where wide */
    Py_ssize_t n;          /* ids so far */
    int wide;
    int64_t *rows; /* 5 per row */
    Py_ssize_t n_rows, room;
} Routes;

/* One id: 1, or WIDE where it does not fit u1 and the ids are u1 */
static int put(Routes *r, int64_t id) {
    if (!r->wide) {
        if (id < 0 || id > 255) return WIDE;
        r->values[r->n++] = (unsigned char)id;
        return OK;
    }
    uint32_t u = (uint32_t)(int32_t)id;
    unsigned char *w = r->values + 4 * r->n++;
    w[0] = (unsigned char)u;
    w[1] = (unsigned char)(u >> 8);
    w[2] = (unsigned char)(u >> 16);
    w[3] = (unsigned char)(u >> 24);
    return OK;
}

static int add_row(Routes *r, int64_t kind, int64_t a, int64_t b, int64_t layers, int64_t k) {
    if (r->n_rows == r->room) {
        Py_ssize_t room = r->room ? 2 * r->room : 64;
        int64_t *rows = realloc(r->rows, (size_t)room * 5 * sizeof(int64_t));
        if (rows == NULL) return NO_MEMORY;
        r->rows = rows;
        r->room = room;
    }
    int64_t *row = r->rows + 5 * r->n_rows++;
    row[0] = kind;
    row[1] = a;
    row[2] = b;
    row[3] = layers;
    row[4] = k;
    return OK;
}

#define CHUNK_QUADS 256 /* 768 bytes: a whole number of int32 */

/* The base64 text s[0:len] as ids appended to r: OK, DECLINE where it is not canonical base64 of a
   whole number of int32 (the ids appended so far are taken back), or WIDE. */
static int decode_ids(const unsigned char *s, Py_ssize_t len, Routes *r) {
    if (len % 4) return DECLINE;
    Py_ssize_t pads = 0;
    if (len && s[len - 1] == '=') pads = (s[len - 2] == '=') ? 2 : 1;
    Py_ssize_t bytes = len / 4 * 3 - pads;
    if (bytes % 4) return DECLINE;
    Py_ssize_t first = r->n, full = len / 4 - (pads ? 1 : 0), q = 0; /* full: quads without `=` */
    unsigned char chunk[CHUNK_QUADS * 3 + 3];
    for (;;) {
        Py_ssize_t n = full - q < CHUNK_QUADS ? full - q : CHUNK_QUADS;
        if (!decode_quads(s + 4 * q, n, chunk)) goto bad;
        q += n;
        Py_ssize_t got = 3 * n; /* a multiple of 4 in every chunk: 768 bytes, and the rest at the end */
        if (q == full && pads) { /* the padded quad: 1 or 2 bytes */
            const unsigned char *t = s + 4 * full;
            uint32_t v = D0[t[0]] | D1[t[1]] | (pads == 1 ? D2[t[2]] : 0);
            if (v & BAD) goto bad;
            chunk[got++] = (unsigned char)(v >> 16);
            if (pads == 1) chunk[got++] = (unsigned char)(v >> 8);
        }
        if (r->wide) {
            memcpy(r->values + 4 * r->n, chunk, (size_t)got);
            r->n += got / 4;
        } else {
            for (Py_ssize_t i = 0; i < got; i += 4) {
                if (chunk[i + 1] | chunk[i + 2] | chunk[i + 3]) return WIDE;
                r->values[r->n++] = chunk[i];
            }
        }
        if (q == full) break;
    }
    return OK;
bad:
    r->n = first;
    return DECLINE;
}

/* An integer within int32 at *pp: optional minus, digits, no leading zero. */
static int read_int(const unsigned char **pp, const unsigned char *end, int64_t *out) {
    const unsigned char *p = *pp;
    int negative = p < end && *p == '-';
    p += negative;
    const unsigned char *digits = p;
    int64_t x = 0;
    while (p < end && *p >= '0' && *p <= '9' && p - digits < 11) x = x * 10 + (*p++ - '0');
    Py_ssize_t n = p - digits;
    if (n == 0 || (n > 1 && *digits == '0') || (p < end && *p >= '0' && *p <= '9')) return 0;
    if (negative) x = -x;
    if (x > INT32_MAX || x < INT32_MIN) return 0;
    *out = x;
    *pp = p;
    return 1;
}

/* After an item of a list: 1 at a comma (p past it and whitespace), 0 at the closing bracket (p on
   it), -1 at anything else. */
static int next_item(const unsigned char **pp, const unsigned char *end) {
    const unsigned char *p = skip(*pp, end);
    if (p < end && *p == ',') {
        *pp = skip(p + 1, end);
        return 1;
    }
    *pp = p;
    return p < end && *p == ']' ? 0 : -1;
}

/* One row of nested lists at p (its `[`): [positions][layers][top_k], the same shape throughout. */
static int read_lists(const unsigned char **pp, const unsigned char *end, Routes *r) {
    const unsigned char *p = skip(*pp + 1, end);
    Py_ssize_t first = r->n, layers = -1, k = -1;
    int more;
    if (p < end && *p == ']') {
        *pp = p + 1;
        return add_row(r, KIND_LISTS, first, 0, 0, 0);
    }
    do { /* a position */
        if (p >= end || *p != '[') return DECLINE;
        p = skip(p + 1, end);
        Py_ssize_t l = 0;
        do { /* a layer */
            if (p >= end || *p != '[') return DECLINE;
            p = skip(p + 1, end);
            Py_ssize_t ids = 0;
            do {
                int64_t id;
                if (!read_int(&p, end, &id)) return DECLINE;
                int status = put(r, id);
                if (status != OK) return status;
                ids++;
            } while ((more = next_item(&p, end)) == 1);
            if (more < 0 || (k >= 0 && ids != k)) return DECLINE;
            k = ids;
            l++;
            p++;
        } while ((more = next_item(&p, end)) == 1);
        if (more < 0 || (layers >= 0 && l != layers)) return DECLINE;
        layers = l;
        p++;
    } while ((more = next_item(&p, end)) == 1);
    if (more < 0) return DECLINE;
    *pp = p + 1;
    return add_row(r, KIND_LISTS, first, r->n - first, layers, k);
}

/* A string at p (its opening quote), its text plain (no escape, control or non-ASCII byte). */
static int read_string(const unsigned char **pp, const unsigned char *base, const unsigned char *end, Routes *r) {
    const unsigned char *open = *pp + 1;
    const unsigned char *close = memchr(open, '"', (size_t)(end - open));
    if (close == NULL) return DECLINE;
    Py_ssize_t first = r->n;
    int status = decode_ids(open, close - open, r);
    if (status == WIDE || status == NO_MEMORY) return status;
    *pp = close + 1;
    if (status == OK) return add_row(r, KIND_BASE64, first, r->n - first, 0, 0);
    for (const unsigned char *c = open; c < close; c++)
        if (*c == '\\' || *c < 0x20 || *c >= 0x80) return DECLINE; /* the full parser judges it */
    return add_row(r, KIND_STRING, open - base, close - base, 0, 0);
}

static int read_routes(const unsigned char *base, Py_ssize_t start, Py_ssize_t end_at, Routes *r) {
    const unsigned char *p = skip(base + start, base + end_at), *end = base + end_at;
    if (p >= end || *p != '[') return DECLINE;
    p = skip(p + 1, end);
    if (p < end && *p == ']') return skip(p + 1, end) == end ? OK : DECLINE;
    int more;
    do {
        int status;
        if (p < end && *p == '"') {
            status = read_string(&p, base, end, r);
        } else if (p < end && *p == '[') {
            status = read_lists(&p, end, r);
        } else if (end - p >= 4 && memcmp(p, "null", 4) == 0) {
            p += 4;
            status = add_row(r, KIND_NULL, 0, 0, 0, 0);
        } else {
            return DECLINE;
        }
        if (status != OK) return status;
    } while ((more = next_item(&p, end)) == 1);
    return more == 0 && skip(p + 1, end) == end ? OK : DECLINE;
}

static PyObject *route_rows(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t start, end;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn:route_rows", &view, &start, &end)) return NULL;
    if (start < 0 || end > view.len || start >= end) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    /* an id takes at least two bytes of text (a digit and a separator; base64: 16/3): room for the
       most there can be as u1, widened if needed, shrunk after (pages never written are never committed) */
    Py_ssize_t most = (end - start) / 2 + 1;
    PyObject *values = PyByteArray_FromStringAndSize(NULL, most);
    if (values == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Routes r = {0};
    int status = WIDE;
    for (int wide = 0; wide < 2 && status == WIDE; wide++) {
        if (wide && PyByteArray_Resize(values, 4 * most) != 0) break;
        r.values = (unsigned char *)PyByteArray_AsString(values);
        r.n = 0;
        r.n_rows = 0;
        r.wide = wide;
        Py_BEGIN_ALLOW_THREADS
        status = read_routes((const unsigned char *)view.buf, start, end, &r);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&view);
    PyObject *out = NULL;
    if (status == NO_MEMORY) {
        PyErr_NoMemory();
    } else if (status == OK && !PyErr_Occurred() &&
               PyByteArray_Resize(values, r.n * (r.wide ? 4 : 1)) == 0) {
        PyObject *rows = PyBytes_FromStringAndSize((const char *)r.rows, r.n_rows * 5 * (Py_ssize_t)sizeof(int64_t));
        if (rows != NULL) out = Py_BuildValue("(ONi)", values, rows, r.wide ? 4 : 1);
    }
    free(r.rows);
    Py_DECREF(values);
    if (out == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return out;
}

/* ---- b64_strings ---- */

static char *encode(const unsigned char *in, Py_ssize_t n, char *w) {
    Py_ssize_t i = 0;
    for (; i + 3 <= n; i += 3, w += 4) {
        uint32_t x = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8 | in[i + 2];
        memcpy(w, PAIRS[x >> 12], 2);
        memcpy(w + 2, PAIRS[x & 4095], 2);
    }
    if (n - i == 1) {
        uint32_t x = (uint32_t)in[i] << 16;
        memcpy(w, PAIRS[x >> 12], 2);
        w[2] = w[3] = '=';
        w += 4;
    } else if (n - i == 2) {
        uint32_t x = (uint32_t)in[i] << 16 | (uint32_t)in[i + 1] << 8;
        memcpy(w, PAIRS[x >> 12], 2);
        w[2] = ALPHABET[(x >> 6) & 63];
        w[3] = '=';
        w += 4;
    }
    return w;
}

#define WIDEN_ITEMS 768 /* 3072 bytes of int32: a whole number of base64 quads */

/* `items` unsigned items of `itemsize` (1 or 2, native order) as little-endian int32, encoded */
static char *encode_widened(const unsigned char *in, Py_ssize_t items, int itemsize, char *w) {
    unsigned char chunk[WIDEN_ITEMS * 4];
    for (Py_ssize_t a = 0; a < items; a += WIDEN_ITEMS) {
        Py_ssize_t n = items - a < WIDEN_ITEMS ? items - a : WIDEN_ITEMS;
        memset(chunk, 0, (size_t)(4 * n));
        for (Py_ssize_t i = 0; i < n; i++) {
            uint32_t v;
            if (itemsize == 1) {
                v = in[a + i];
            } else {
                uint16_t h;
                memcpy(&h, in + 2 * (a + i), 2);
                v = h;
            }
            chunk[4 * i] = (unsigned char)v;
            chunk[4 * i + 1] = (unsigned char)(v >> 8);
        }
        w = encode(chunk, 4 * n, w);
    }
    return w;
}

/* u1 items widened to int32 come three to 12 bytes, `a 0 0 0 b 0 0 0 c 0 0 0`: four quads, of which
   the first three hold one item each and the last none. U1_QUADS[j][v]: the quad's four characters
   where item v lands at byte j of it. */
static char U1_QUADS[3][256][4];

static void build_u1_quads(void) {
    for (int j = 0; j < 3; j++)
        for (int v = 0; v < 256; v++) {
            unsigned char quad[3] = {0, 0, 0};
            quad[j] = (unsigned char)v;
            encode(quad, 3, U1_QUADS[j][v]);
        }
}

/* encode_widened of u1 items: three items at a time by table, the last one or two as encode_widened */
static char *encode_u1_widened(const unsigned char *in, Py_ssize_t items, char *w) {
    Py_ssize_t i = 0;
    for (; i + 3 <= items; i += 3, w += 16) {
        memcpy(w, U1_QUADS[0][in[i]], 4);
        memcpy(w + 4, U1_QUADS[1][in[i + 1]], 4);
        memcpy(w + 8, U1_QUADS[2][in[i + 2]], 4);
        memcpy(w + 12, "AAAA", 4);
    }
    return encode_widened(in + i, items - i, 1, w);
}

static Py_ssize_t encoded_length(Py_ssize_t bytes) { return (bytes + 2) / 3 * 4; }

static PyObject *b64_strings(PyObject *self, PyObject *args) {
    PyObject *blocks;
    int itemsize;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oi:b64_strings", &blocks, &itemsize)) return NULL;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4) {
        PyErr_SetString(PyExc_ValueError, "itemsize is 1 or 2 (widened to int32), or 4 (as they are)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(blocks, "blocks: a sequence of buffers");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Size(seq);
    Py_buffer *views = count ? calloc((size_t)count, sizeof(Py_buffer)) : NULL;
    if (count && views == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t got = 0, total = 2 + (count ? count - 1 : 0);
    PyObject *out = NULL;
    for (; got < count; got++) {
        PyObject *block = PySequence_GetItem(seq, got);
        int failed = block == NULL || PyObject_GetBuffer(block, &views[got], PyBUF_SIMPLE) != 0;
        Py_XDECREF(block);
        if (failed) goto done;
        Py_ssize_t bytes = itemsize == 4 ? views[got].len : views[got].len / itemsize * 4;
        if (itemsize != 4 && views[got].len % itemsize) {
            got++;
            PyErr_SetString(PyExc_ValueError, "a block's length is not a whole number of items");
            goto done;
        }
        total += 2 + encoded_length(bytes);
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) goto done;
    char *w = PyBytes_AsString(out);
    Py_BEGIN_ALLOW_THREADS
    *w++ = '[';
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i) *w++ = ',';
        *w++ = '"';
        const unsigned char *in = (const unsigned char *)views[i].buf;
        if (itemsize == 4)
            w = encode(in, views[i].len, w);
        else if (itemsize == 1)
            w = encode_u1_widened(in, views[i].len, w);
        else
            w = encode_widened(in, views[i].len / itemsize, itemsize, w);
        *w++ = '"';
    }
    *w++ = ']';
    Py_END_ALLOW_THREADS
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    free(views);
    Py_DECREF(seq);
    return out;
}

/* ---- int_lists, float_lists ---- */

/* item i of a block of `itemsize` (1, 2, 4 or 8) native integers, signed or not, as (negative, magnitude) */
static inline uint64_t item(const unsigned char *data, Py_ssize_t i, int itemsize, int is_signed, int *negative) {
    int64_t s = 0;
    uint64_t u = 0;
    switch (itemsize) {
    case 1: if (is_signed) s = ((const int8_t *)data)[i]; else u = data[i]; break;
    case 2: if (is_signed) s = ((const int16_t *)data)[i]; else u = ((const uint16_t *)data)[i]; break;
    case 4: if (is_signed) s = ((const int32_t *)data)[i]; else u = ((const uint32_t *)data)[i]; break;
    default: if (is_signed) s = ((const int64_t *)data)[i]; else u = ((const uint64_t *)data)[i]; break;
    }
    if (!is_signed) {
        *negative = 0;
        return u;
    }
    *negative = s < 0;
    return s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
}

static inline char *write_uint(char *w, uint64_t v) {
    int n = digits_of(v);
    digits_at(w + n, v);
    return w + n;
}

/* What a block's items are: native integers of `itemsize` bytes, signed or not, or float32; and
   the end of the text's buffer (a number below 10^8 is written with one 8-byte store before it) */
typedef struct {
    int itemsize, is_signed, floats;
    const char *limit;
} Items;

/* The brackets and commas of one block as nested lists (every dimension > 0, or an empty first one) */
static Py_ssize_t lists_length(const Py_buffer *b, Py_ssize_t n) {
    Py_ssize_t lists = 1, elements = 0, width = 1;
    if (n == 0) return 2;
    for (int d = 0; d < b->ndim; d++) {
        width *= b->shape[d];
        elements += width;
        if (d < b->ndim - 1) lists += width;
    }
    return 2 * lists + (elements - lists); /* brackets, and a comma between siblings */
}

/* every u1 id's text and a comma, padded to 4 bytes; and its length (digits and comma) */
static char U1_TEXT[256][4];
static unsigned char U1_LEN[256];

static void build_u1_text(void) {
    for (int v = 0; v < 256; v++) {
        int n = digits_of((uint64_t)v);
        digits_at(U1_TEXT[v] + n, (uint64_t)v);
        U1_TEXT[v][n] = ',';
        U1_LEN[v] = (unsigned char)(n + 1);
    }
}

/* The bytes of one block of integers as nested lists */
static Py_ssize_t int_block_length(const Py_buffer *b, const Items *k) {
    Py_ssize_t n = b->len / k->itemsize, total = lists_length(b, n);
    const unsigned char *data = (const unsigned char *)b->buf;
    if (k->itemsize == 1 && !k->is_signed) {
        for (Py_ssize_t i = 0; i < n; i++) total += U1_LEN[data[i]] - 1; /* its digits */
        return total;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int negative;
        uint64_t v = item(data, i, k->itemsize, k->is_signed, &negative);
        total += digits_of(v) + negative;
    }
    return total;
}

/* `n` (> 0) u1 ids as `a,b,c`, the row's text without its brackets. Each id but the last is one
   4-byte store of U1_TEXT: what it writes past its text lies within the next id's digit, its comma
   or bracket and the row's `]` (written after), so never past the row. */
static char *write_u1_row(char *w, const unsigned char *ids, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n - 1; j++) {
        memcpy(w, U1_TEXT[ids[j]], 4);
        w += U1_LEN[ids[j]];
    }
    unsigned char v = ids[n - 1];
    memcpy(w, U1_TEXT[v], (size_t)U1_LEN[v] - 1);
    return w + U1_LEN[v] - 1;
}

/* items i .. i + count - 1 of a block, comma-separated */
static inline char *write_items(char *w, const unsigned char *data, Py_ssize_t i, Py_ssize_t count, const Items *k) {
    Py_ssize_t end = i + count;
    if (k->floats) {
        for (Py_ssize_t j = i; j < end; j++) {
            uint32_t bits;
            memcpy(&bits, data + 4 * j, 4);
            if (j > i) *w++ = ',';
            w = f32_text(w, bits);
        }
    } else if (k->itemsize == 1 && !k->is_signed) {
        if (count > 0) w = write_u1_row(w, data + i, count);
    } else {
        for (Py_ssize_t j = i; j < end; j++) {
            int negative;
            uint64_t v = item(data, j, k->itemsize, k->is_signed, &negative);
            if (j > i) *w++ = ',';
            if (negative) *w++ = '-';
            if (v < 100000000 && w + 8 <= k->limit) {
                int n = digits_of(v);
                uint64_t text = eight_digits((uint32_t)v) >> (8 * (8 - n));
                memcpy(w, &text, 8);
                w += n;
            } else {
                w = write_uint(w, v);
            }
        }
    }
    return w;
}

static char *write_block(char *w, const Py_buffer *b, const Items *k) {
    Py_ssize_t n = b->len / k->itemsize, per_list[8];
    int dims = b->ndim;
    if (n == 0) {
        memcpy(w, "[]", 2);
        return w + 2;
    }
    /* rows: the innermost lists, `last` items each; per_list[d]: rows in one list of depth d (1 ..
       dims - 2: the lists between the outermost and the rows) */
    Py_ssize_t last = b->shape[dims - 1], rows = n / last, size = 1;
    for (int d = dims - 2; d >= 1; d--) {
        size *= b->shape[d];
        per_list[d] = size;
    }
    memset(w, '[', (size_t)(dims - 1));
    w += dims - 1;
    for (Py_ssize_t r = 0; r < rows; r++) {
        if (r) {
            int closing = 0;
            for (int d = dims - 2; d >= 1 && r % per_list[d] == 0; d--) closing++;
            memset(w, ']', (size_t)closing);
            w += closing;
            *w++ = ',';
            memset(w, '[', (size_t)closing);
            w += closing;
        }
        *w++ = '[';
        w = write_items(w, (const unsigned char *)b->buf, r * last, last, k);
        *w++ = ']';
    }
    memset(w, ']', (size_t)(dims - 1));
    return w + dims - 1;
}

/* `[block, ...]` at w: the byte after it */
static char *write_blocks(char *w, const Py_buffer *views, Py_ssize_t count, const Items *k) {
    *w++ = '[';
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i) *w++ = ',';
        w = write_block(w, &views[i], k);
    }
    *w++ = ']';
    return w;
}

/* float32's format in the buffer protocol, native (little-endian) */
static int is_float32(const Py_buffer *b) {
    const char *f = b->format;
    if (f != NULL && (*f == '<' || *f == '=' || *f == '@')) f++;
    return b->itemsize == 4 && f != NULL && strcmp(f, "f") == 0;
}

static void release_views(Py_buffer *views, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) PyBuffer_Release(&views[i]);
    free(views);
}

/* A view of each of the blocks, checked (1 to 8 dimensions, none empty but the first; float32 where
   k->floats): the views (free with release_views), or NULL with an exception set */
static Py_buffer *block_views(PyObject *blocks, const Items *k, Py_ssize_t *count) {
    PyObject *seq = PySequence_Fast(blocks, "blocks: a sequence of arrays");
    if (seq == NULL) return NULL;
    *count = PySequence_Size(seq);
    Py_buffer *views = calloc((size_t)*count + 1, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    int failed = views == NULL;
    if (failed) PyErr_NoMemory();
    for (; !failed && got < *count; got++) {
        PyObject *block = PySequence_GetItem(seq, got);
        int flags = k->floats ? PyBUF_ND | PyBUF_FORMAT : PyBUF_ND;
        failed = block == NULL || PyObject_GetBuffer(block, &views[got], flags) != 0;
        Py_XDECREF(block);
        if (failed) break;
        const Py_buffer *b = &views[got];
        int empty_inside = b->len == 0 && b->ndim > 0 && b->shape[0] != 0;
        if (b->ndim < 1 || b->ndim > 8 || b->len % k->itemsize || empty_inside) {
            PyErr_SetString(PyExc_ValueError, "a block: 1 to 8 dimensions, none empty but the first");
            failed = 1;
        } else if (k->floats && !is_float32(b)) {
            PyErr_SetString(PyExc_ValueError, "a block: native float32");
            failed = 1;
        }
    }
    Py_DECREF(seq);
    if (!failed) return views;
    release_views(views, got); /* the views taken: the failed one too where its buffer was given */
    return NULL;
}

static PyObject *int_lists(PyObject *self, PyObject *args) {
    PyObject *blocks;
    Items k = {0, 0, 0, NULL};
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "Oip:int_lists", &blocks, &k.itemsize, &k.is_signed)) return NULL;
    if (k.itemsize != 1 && k.itemsize != 2 && k.itemsize != 4 && k.itemsize != 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize is 1, 2, 4 or 8");
        return NULL;
    }
    Py_buffer *views = block_views(blocks, &k, &count);
    if (views == NULL) return NULL;
    Py_ssize_t total = 2 + (count ? count - 1 : 0);
    Py_BEGIN_ALLOW_THREADS /* a pass over every id: other threads go on meanwhile */
    for (Py_ssize_t i = 0; i < count; i++) total += int_block_length(&views[i], &k);
    Py_END_ALLOW_THREADS
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out != NULL) {
        char *w = PyBytes_AsString(out);
        k.limit = w + total;
        Py_BEGIN_ALLOW_THREADS
        write_blocks(w, views, count, &k);
        Py_END_ALLOW_THREADS
    }
    release_views(views, count);
    return out;
}

/* The text is written to room for the longest numbers (and f32_text's scratch past the last), then
   copied to the bytes of its length: both with the GIL released. */
static PyObject *float_lists(PyObject *self, PyObject *args) {
    PyObject *blocks, *out = NULL;
    Items k = {4, 1, 1, NULL};
    Py_ssize_t count;
    (void)self;
    if (!PyArg_ParseTuple(args, "O:float_lists", &blocks)) return NULL;
    Py_buffer *views = block_views(blocks, &k, &count);
    if (views == NULL) return NULL;
    Py_ssize_t most = 2 + (count ? count - 1 : 0) + F32_TEXT_ROOM;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t n = views[i].len / 4;
        most += lists_length(&views[i], n) + n * F32_TEXT_MOST;
    }
    char *text = malloc((size_t)most), *end = NULL;
    if (text == NULL) {
        PyErr_NoMemory();
    } else {
        k.limit = text + most;
        Py_BEGIN_ALLOW_THREADS
        end = write_blocks(text, views, count, &k);
        Py_END_ALLOW_THREADS
        out = PyBytes_FromStringAndSize(NULL, end - text);
    }
    if (out != NULL) {
        char *w = PyBytes_AsString(out);
        Py_BEGIN_ALLOW_THREADS
        memcpy(w, text, (size_t)(end - text));
        Py_END_ALLOW_THREADS
    }
    free(text);
    release_views(views, count);
    return out;
}

/* ---- prompt_entries ---- */

typedef struct {
    const char *numbers; /* orjson's "[a,b,...]" of every slot's log-prob */
    Py_ssize_t numbers_len;
    const int64_t *ids, *first_rank;
    const unsigned char *keep;
    Py_ssize_t positions, slots;
    const unsigned char *pool;
    const int64_t *start, *length;
    Py_ssize_t pool_len, vocab;
    Py_ssize_t *stops; /* [positions * slots]: where each slot's number ends in the text */
} Entries;

/* The bytes of the entries, or -1 where an id is outside the pool or the numbers run short; notes
   where each number ends (stops) for write_entries. */
static Py_ssize_t entries_length(const Entries *e) {
    const char *text = e->numbers, *end = e->numbers + e->numbers_len;
    Py_ssize_t total = 0, at = 0, p = 1;
    for (Py_ssize_t i = 0; i < e->positions; i++) {
        total += 1; /* the position's closing brace */
        for (Py_ssize_t j = 0; j < e->slots; j++, at++) {
            if (text + p >= end) return -1;
            const char *q = text + p;
            while (q < end && *q != ',' && *q != ']') q++;
            Py_ssize_t stop = q - text;
            e->stops[at] = stop;
            if (e->keep[at]) {
                int64_t id = e->ids[at];
                uint64_t rank = j ? (uint64_t)j : (uint64_t)e->first_rank[i];
                if (id < 0 || id >= e->vocab || e->start[id] + e->length[id] > e->pool_len) return -1;
                total += (j ? 2 : 3) + digits_of((uint64_t)id) + 13; /* ,"<id>":{"logprob": */
                total += stop - p;                                  /* the number */
                total += 8 + digits_of(rank) + 17;                  /* ,"rank":<r>,"decoded_token": */
                total += e->length[id];                             /* "<decoded>"} */
            }
            p = stop + 1;
        }
    }
    return total;
}

static void write_entries(const Entries *e, char *w) {
    Py_ssize_t at = 0, p = 1;
    for (Py_ssize_t i = 0; i < e->positions; i++) {
        for (Py_ssize_t j = 0; j < e->slots; j++, at++) {
            Py_ssize_t begin = p;
            p = e->stops[at] + 1;
            if (!e->keep[at]) continue;
            int64_t id = e->ids[at];
            uint64_t rank = j ? (uint64_t)j : (uint64_t)e->first_rank[i];
            if (j) {
                memcpy(w, ",\"", 2);
                w += 2;
            } else {
                memcpy(w, ",{\"", 3);
                w += 3;
            }
            w = write_uint(w, (uint64_t)id);
            memcpy(w, "\":{\"logprob\":", 13);
            w += 13;
            memcpy(w, e->numbers + begin, (size_t)(p - 1 - begin));
            w += p - 1 - begin;
            memcpy(w, ",\"rank\":", 8);
            w += 8;
            w = write_uint(w, rank);
            memcpy(w, ",\"decoded_token\":", 17);
            w += 17;
            memcpy(w, e->pool + e->start[id], (size_t)e->length[id]);
            w += e->length[id];
        }
        *w++ = '}';
    }
}

static PyObject *prompt_entries(PyObject *self, PyObject *args) {
    Py_buffer numbers, ids, first_rank, keep, pool, start, length;
    Py_ssize_t slots;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*ny*y*y*:prompt_entries", &numbers, &ids, &first_rank, &keep, &slots,
                          &pool, &start, &length))
        return NULL;
    Entries e = {
        .numbers = (const char *)numbers.buf,
        .numbers_len = numbers.len,
        .ids = (const int64_t *)ids.buf,
        .first_rank = (const int64_t *)first_rank.buf,
        .keep = (const unsigned char *)keep.buf,
        .positions = first_rank.len / 8,
        .slots = slots,
        .pool = (const unsigned char *)pool.buf,
        .start = (const int64_t *)start.buf,
        .length = (const int64_t *)length.buf,
        .pool_len = pool.len,
        .vocab = start.len / 8 < length.len / 8 ? start.len / 8 : length.len / 8,
    };
    PyObject *out = NULL;
    int sized = slots > 0 && numbers.len >= 2 && ids.len == e.positions * slots * 8 &&
                keep.len == e.positions * slots;
    Py_ssize_t total = -1;
    e.stops = sized ? malloc((size_t)(e.positions * slots + 1) * sizeof(Py_ssize_t)) : NULL;
    if (sized && e.stops == NULL) {
        PyErr_NoMemory();
    } else if (sized) {
        Py_BEGIN_ALLOW_THREADS
        total = entries_length(&e);
        Py_END_ALLOW_THREADS
    }
    if (total < 0 && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "prompt_entries: the arrays do not fit together");
    } else if (total >= 0 && (out = PyBytes_FromStringAndSize(NULL, total)) != NULL) {
        char *w = PyBytes_AsString(out);
        Py_BEGIN_ALLOW_THREADS
        write_entries(&e, w);
        Py_END_ALLOW_THREADS
    }
    free(e.stops);
    PyBuffer_Release(&numbers);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&first_rank);
    PyBuffer_Release(&keep);
    PyBuffer_Release(&pool);
    PyBuffer_Release(&start);
    PyBuffer_Release(&length);
    return out;
}

/* ---- route_faults ---- */

typedef struct {
    Py_ssize_t groups;   /* (position, layer) groups of k ids */
    Py_ssize_t k;        /* ids a group */
    Py_ssize_t layers;   /* groups a position */
    int64_t experts;     /* ids are 0 .. experts - 1 */
    const unsigned char *keep; /* [groups / layers] 0: the position is not judged; NULL: every one is */
    int kind;            /* out: 0 none, 1 an id out of range, 2 an id twice in one group */
    Py_ssize_t at;       /* out: the flat index of the id (1), the group (2) */
} Faults;

/* One pass over the groups: the first id out of range in C order ends it; else the first group that
   names an expert twice (a 256-bit set where every id is below 256, else the k(k-1)/2 pairs). */
#define ROUTE_SCAN(NAME, T)                                                                        \
    static void NAME(const T *ids, Faults *f) {                                                    \
        Py_ssize_t repeat = -1;                                                                    \
        for (Py_ssize_t g = 0; g < f->groups; g++) {                                               \
            if (f->keep != NULL && g % f->layers == 0 && !f->keep[g / f->layers]) {                \
                g += f->layers - 1; /* the position's groups are not judged */                     \
                continue;                                                                          \
            }                                                                                      \
            const T *x = ids + g * f->k;                                                           \
            for (Py_ssize_t s = 0; s < f->k; s++) {                                                \
                if ((int64_t)x[s] < 0 || (int64_t)x[s] >= f->experts) {                            \
                    f->kind = 1;                                                                   \
                    f->at = g * f->k + s;                                                          \
                    return;                                                                        \
                }                                                                                  \
            }                                                                                      \
            if (repeat >= 0) continue;                                                             \
            if (f->experts <= 256) {                                                               \
                uint64_t seen[4] = {0, 0, 0, 0};                                                   \
                for (Py_ssize_t s = 0; s < f->k; s++) {                                            \
                    uint64_t bit = (uint64_t)1 << ((uint64_t)x[s] & 63);                           \
                    uint64_t *word = &seen[(uint64_t)x[s] >> 6];                                   \
                    if (*word & bit) {                                                             \
                        repeat = g;                                                                \
                        break;                                                                     \
                    }                                                                              \
                    *word |= bit;                                                                  \
                }                                                                                  \
            } else {                                                                               \
                for (Py_ssize_t a = 0; a + 1 < f->k && repeat < 0; a++)                            \
                    for (Py_ssize_t b = a + 1; b < f->k; b++)                                      \
                        if (x[a] == x[b]) {                                                        \
                            repeat = g;                                                            \
                            break;                                                                 \
                        }                                                                          \
            }                                                                                      \
        }                                                                                          \
        if (repeat >= 0) {                                                                         \
            f->kind = 2;                                                                           \
            f->at = repeat;                                                                        \
        }                                                                                          \
    }

ROUTE_SCAN(scan_u1, uint8_t)
ROUTE_SCAN(scan_u2, uint16_t)
ROUTE_SCAN(scan_i4, int32_t)
ROUTE_SCAN(scan_i8, int64_t)

#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

/* u1 ids with k = 8 (Qwen3-MoE's, DeepSeek's top 8) and at most 128 or 256 experts: each group one
   64-bit word. In range: with at most 128 experts, an id b is past them iff b or b + 128 - experts has
   its high bit set (no carry crosses a byte); with 256 every byte is. A repeat: a zero byte of the
   word XOR its rotations by 1 .. 4 bytes, which pair every two slots. A fault out of range sends the
   whole scan to scan_u1, which names the first; anything else goes there too. */
static void scan_u1_k8(const uint8_t *ids, Faults *f) {
    if (f->experts > 128 && f->experts < 256) {
        scan_u1(ids, f);
        return;
    }
    uint64_t shift = f->experts <= 128 ? (uint64_t)(128 - f->experts) * ONES : 0;
    uint64_t past = f->experts <= 128 ? HIGHS : 0;
    Py_ssize_t repeat = -1;
    for (Py_ssize_t g = 0; g < f->groups; g++) {
        if (f->keep != NULL && !f->keep[g / f->layers]) continue;
        uint64_t v, zero = 0;
        memcpy(&v, ids + g * 8, 8);
        if ((v | (v + shift)) & past) {
            scan_u1(ids, f);
            return;
        }
        if (repeat >= 0) continue;
        for (int r = 8; r <= 32; r += 8) {
            uint64_t y = v ^ ((v << r) | (v >> (64 - r)));
            zero |= (y - ONES) & ~y & HIGHS;
        }
        if (zero) repeat = g;
    }
    if (repeat >= 0) {
        f->kind = 2;
        f->at = repeat;
    }
}

static PyObject *route_faults(PyObject *self, PyObject *args) {
    Py_buffer ids, keep = {0};
    int itemsize, is_signed;
    Py_ssize_t layers, k;
    long long experts;
    PyObject *keep_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*ipnnLO:route_faults", &ids, &itemsize, &is_signed, &layers, &k, &experts,
                          &keep_obj))
        return NULL;
    Faults f = {0, k, layers, experts, NULL, 0, -1};
    int kind_ok = (itemsize == 1 && !is_signed) || (itemsize == 2 && !is_signed) || (itemsize == 4 && is_signed) ||
                  (itemsize == 8 && is_signed);
    Py_ssize_t per = layers * k;
    if (!kind_ok || layers < 1 || k < 1 || ids.len % ((Py_ssize_t)itemsize * per)) {
        PyBuffer_Release(&ids);
        PyErr_SetString(PyExc_ValueError, "route_faults: u1, u2, i4 or i8 ids, [positions, layers, k]");
        return NULL;
    }
    f.groups = ids.len / itemsize / k;
    if (keep_obj != Py_None) {
        if (PyObject_GetBuffer(keep_obj, &keep, PyBUF_SIMPLE) < 0) {
            PyBuffer_Release(&ids);
            return NULL;
        }
        if (keep.len != f.groups / layers) {
            PyBuffer_Release(&ids);
            PyBuffer_Release(&keep);
            PyErr_SetString(PyExc_ValueError, "route_faults: keep holds one byte a position");
            return NULL;
        }
        f.keep = (const unsigned char *)keep.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    switch (itemsize) {
    case 1:
        if (k == 8)
            scan_u1_k8((const uint8_t *)ids.buf, &f);
        else
            scan_u1((const uint8_t *)ids.buf, &f);
        break;
    case 2: scan_u2((const uint16_t *)ids.buf, &f); break;
    case 4: scan_i4((const int32_t *)ids.buf, &f); break;
    default: scan_i8((const int64_t *)ids.buf, &f); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ids);
    if (keep_obj != Py_None) PyBuffer_Release(&keep);
    return Py_BuildValue("(in)", f.kind, f.at);
}

static PyMethodDef methods[] = {
    {"int_rows", int_rows, METH_VARARGS,
     "int_rows(buffer, start, end) -> (values, counts) | None: buffer[start:end] as rows of int64"},
    {"members", members, METH_VARARGS,
     "members(buffer) -> bytes | None: the top-level members of a JSON object, five int64 each"},
    {"route_rows", route_rows, METH_VARARGS,
     "route_rows(buffer, start, end) -> (values, rows, itemsize) | None: buffer[start:end] as routed_experts"},
    {"int_lists", int_lists, METH_VARARGS,
     "int_lists(blocks, itemsize, signed) -> bytes: the JSON array of the blocks as nested lists"},
    {"float_lists", float_lists, METH_VARARGS,
     "float_lists(blocks) -> bytes: the JSON array of float32 blocks as nested lists, as orjson writes them"},
    {"prompt_entries", prompt_entries, METH_VARARGS,
     "prompt_entries(numbers, ids, first_rank, keep, slots, pool, start, length) -> bytes: vLLM's entries"},
    {"b64_strings", b64_strings, METH_VARARGS,
     "b64_strings(blocks, itemsize) -> bytes: the JSON array of the blocks' base64 strings"},
    {"route_faults", route_faults, METH_VARARGS,
     "route_faults(ids, itemsize, signed, layers, k, experts, keep) -> (kind, at): the first fault of routes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jsonrows", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jsonrows(void) {
    build_tables();
    build_u1_quads();
    build_u1_text();
    f32_tables();
    return PyModule_Create(&module);
}
