/* The C core of specrl.speculation.suffix_index: the same algorithm as the plain-Python twin there
 * (_TwinIndex, _TwinContext), which the tests compare it against. Read that module's docstring
 * first; this file only adds the memory layout.
 *
 * Index: tokens in a ring of `capacity` int32 slots (a SEPARATOR after each document); positions
 * are absolute int64 (slot = position % capacity) and the kept ones are [base, end). Per gram
 * order r: heads[r][bucket] = (most recent position + 1) mod 2^32 (0: empty; decoded against a
 * position known to be later, so it is exact while fewer than 2^32 tokens separate them), and
 * prev[r][slot] = distance to the previous position in the same bucket (0: none). A chain is
 * walked while positions stay >= base: a slot is only reused after its position is evicted.
 * Context: one request's tokens, prefix hashes and, per order, int32 heads/prev over positions.
 * Every method runs with the GIL held and never calls back into Python while the index is in
 * an inconsistent state, so calls from several threads are atomic.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define SEPARATOR (-1)
#define BASE 0x100000001B3ULL
#define MIX 0x9E3779B97F4A7C15ULL
#define MAX_TOKEN ((1LL << 31) - 2)
#define MIN_BITS 6
#define MAX_ORDERS 2

typedef struct {
    int min_match, max_match, max_occ, max_steps, n_orders;
    int orders[MAX_ORDERS];
    uint64_t powers[MAX_ORDERS];
    int own_bonus;
} Params;

typedef struct {
    PyObject_HEAD
    Params params;
    int64_t capacity;
    int bits;
    int32_t *ring;
    uint32_t *heads[MAX_ORDERS];
    uint32_t *prev[MAX_ORDERS];
    int64_t *starts;                /* circular deque of kept documents' start positions */
    int64_t starts_cap, starts_front, starts_count;
    int64_t base, end;
    long long documents, tokens, evicted;
    /* propose scratch: occurrences (match length, next position) per source, the vote table */
    int64_t *own_len, *own_pos, *glob_len, *glob_pos;
    int32_t *own_next, *glob_next;
    const struct ContextObject **own_src;   /* the context each own occurrence is in (the request's, or a peer's) */
    int32_t *vote_keys, *vote_order;
    int64_t *vote_count;
    int64_t vote_mask;
    int32_t *draft;
    int64_t draft_cap;
} IndexObject;

typedef struct ContextObject {
    PyObject_HEAD
    IndexObject *owner;
    int64_t n, cap;
    int bits;
    int32_t *tokens;
    uint64_t *prefix;               /* n + 1 entries */
    int32_t *heads[MAX_ORDERS];
    int32_t *prev[MAX_ORDERS];
} ContextObject;

static PyTypeObject IndexType, ContextType;

static inline int64_t bucket_of(uint64_t gram_hash, int bits) {
    return (int64_t)((gram_hash * MIX) >> (64 - bits));
}

static int bits_for(int64_t slots) {
    int bits = 0;
    int64_t v = (slots > 1 ? slots : 1) - 1;
    while (v > 0) { bits++; v >>= 1; }
    return bits < MIN_BITS ? MIN_BITS : bits;
}

/* A head's position: s = (p + 1) mod 2^32 for some p < ref. -1 when empty. */
static inline int64_t decode_head(uint32_t s, int64_t ref) {
    if (s == 0) return -1;
    uint32_t d = (uint32_t)((uint32_t)ref - s);
    return ref - 1 - (int64_t)d;
}

/* tokens -> malloc'd int32 array (*out, *len); -1 with an exception set on bad input. */
static int read_tokens(PyObject *seq, int32_t **out, Py_ssize_t *len) {
    PyObject *fast = PySequence_Fast(seq, "tokens must be a sequence of token ids");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    int32_t *buf = PyMem_Malloc(sizeof(int32_t) * (n ? n : 1));
    if (!buf) { Py_DECREF(fast); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long t = PyLong_AsLongLong(items[i]);
        if (t == -1 && PyErr_Occurred()) { PyMem_Free(buf); Py_DECREF(fast); return -1; }
        if (t < 0 || t > MAX_TOKEN) {
            PyErr_Format(PyExc_ValueError, "token ids must be in [0, %lld], got %lld", MAX_TOKEN, t);
            PyMem_Free(buf); Py_DECREF(fast); return -1;
        }
        buf[i] = (int32_t)t;
    }
    Py_DECREF(fast);
    *out = buf; *len = n;
    return 0;
}

/* ---- Context --------------------------------------------------------------------------------- */

static inline uint64_t ctx_gram_hash(const ContextObject *c, int r, int64_t end) {
    const Params *pr = &c->owner->params;
    return c->prefix[end] - c->prefix[end - pr->orders[r]] * pr->powers[r];
}

static void ctx_link(ContextObject *c, int64_t p) {
    const Params *pr = &c->owner->params;
    for (int r = 0; r < pr->n_orders; r++) {
        if (p + 1 >= pr->orders[r]) {
            int64_t b = bucket_of(ctx_gram_hash(c, r, p + 1), c->bits);
            c->prev[r][p] = c->heads[r][b];
            c->heads[r][b] = (int32_t)p;
        } else {
            c->prev[r][p] = -1;
        }
    }
}

static int ctx_reserve(ContextObject *c, int64_t need) {
    if (need <= c->cap) return 0;
    int64_t cap = c->cap ? c->cap : 64;
    while (cap < need) cap *= 2;
    int32_t *t = PyMem_Realloc(c->tokens, sizeof(int32_t) * cap);
    if (!t) return -1;
    c->tokens = t;
    uint64_t *h = PyMem_Realloc(c->prefix, sizeof(uint64_t) * (cap + 1));
    if (!h) return -1;
    c->prefix = h;
    for (int r = 0; r < c->owner->params.n_orders; r++) {
        int32_t *p = PyMem_Realloc(c->prev[r], sizeof(int32_t) * cap);
        if (!p) return -1;
        c->prev[r] = p;
    }
    c->cap = cap;
    return 0;
}

static int ctx_set_bits(ContextObject *c, int bits) {
    for (int r = 0; r < c->owner->params.n_orders; r++) {
        int32_t *h = PyMem_Realloc(c->heads[r], sizeof(int32_t) << bits);
        if (!h) return -1;
        memset(h, 0xff, sizeof(int32_t) << bits);   /* -1: empty */
        c->heads[r] = h;
    }
    c->bits = bits;
    return 0;
}

static PyObject *Context_extend(ContextObject *c, PyObject *arg) {
    int32_t *buf; Py_ssize_t m;
    if (read_tokens(arg, &buf, &m) < 0) return NULL;
    if (c->n + m >= INT32_MAX) {
        PyMem_Free(buf);
        return PyErr_Format(PyExc_OverflowError, "a request context holds at most %d tokens", INT32_MAX - 1);
    }
    if (ctx_reserve(c, c->n + m) < 0) { PyMem_Free(buf); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t p = c->n;
        c->tokens[p] = buf[i];
        c->prefix[p + 1] = c->prefix[p] * BASE + (uint64_t)buf[i] + 1;
        c->n = p + 1;
        if (c->n > ((int64_t)1 << c->bits) / 2) {   /* double the table and relink everything */
            if (ctx_set_bits(c, c->bits + 1) < 0) { PyMem_Free(buf); return PyErr_NoMemory(); }
            for (int64_t q = 0; q < c->n; q++) ctx_link(c, q);
        } else {
            ctx_link(c, p);
        }
    }
    PyMem_Free(buf);
    Py_RETURN_NONE;
}

static Py_ssize_t Context_len(ContextObject *c) { return (Py_ssize_t)c->n; }

static PyObject *Context_tolist(ContextObject *c, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(c->n);
    if (!out) return NULL;
    for (int64_t i = 0; i < c->n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(c->tokens[i]));
    return out;
}

static void Context_dealloc(ContextObject *c) {
    PyMem_Free(c->tokens);
    PyMem_Free(c->prefix);
    for (int r = 0; r < MAX_ORDERS; r++) { PyMem_Free(c->heads[r]); PyMem_Free(c->prev[r]); }
    Py_XDECREF(c->owner);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyMethodDef Context_methods[] = {
    {"extend", (PyCFunction)Context_extend, METH_O, "extend(tokens): append committed token ids."},
    {"tolist", (PyCFunction)Context_tolist, METH_NOARGS, "tolist() -> the context's token ids."},
    {NULL},
};

static PySequenceMethods Context_as_sequence = {.sq_length = (lenfunc)Context_len};

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "specrl.speculation._suffix_index.Context",
    .tp_doc = "One request's own tokens and hash chains; made by Index.new_context().",
    .tp_basicsize = sizeof(ContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Context_dealloc,
    .tp_methods = Context_methods,
    .tp_as_sequence = &Context_as_sequence,
};

/* ---- Index ----------------------------------------------------------------------------------- */

static int Index_init(IndexObject *self, PyObject *args, PyObject *kwds) {
    long long capacity; int min_match, max_match, max_occ, own_bonus;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Index takes positional arguments");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "Liiii", &capacity, &min_match, &max_match, &max_occ, &own_bonus)) return -1;
    if (self->params.n_orders) { PyErr_SetString(PyExc_RuntimeError, "Index is already initialised"); return -1; }
    if (capacity < 0 || capacity >= (1LL << 31) || min_match < 2 || max_match < min_match || max_match > 4096
        || max_occ < 1 || max_occ > (1 << 20) || own_bonus < 0 || own_bonus > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "Index needs 0 <= capacity < 2^31, 2 <= min_match <= max_match <= 4096, "
                        "1 <= max_occurrences <= 2^20, 0 <= own_bonus <= 2^20");
        return -1;
    }
    Params *pr = &self->params;
    pr->min_match = min_match; pr->max_match = max_match; pr->max_occ = max_occ; pr->max_steps = 4 * max_occ;
    pr->own_bonus = own_bonus;
    pr->orders[pr->n_orders++] = min_match;   /* the same orders as orders_for() in suffix_index.py */
    if (max_match > min_match) pr->orders[pr->n_orders++] = max_match;
    for (int r = 0; r < pr->n_orders; r++) {
        uint64_t p = 1;
        for (int i = 0; i < pr->orders[r]; i++) p *= BASE;
        pr->powers[r] = p;
    }
    self->capacity = capacity;
    if (capacity > 0) {
        self->bits = bits_for(capacity);
        self->ring = PyMem_Malloc(sizeof(int32_t) * capacity);
        if (!self->ring) { PyErr_NoMemory(); return -1; }
        for (int r = 0; r < pr->n_orders; r++) {
            self->heads[r] = PyMem_Calloc((size_t)1 << self->bits, sizeof(uint32_t));
            self->prev[r] = PyMem_Malloc(sizeof(uint32_t) * capacity);
            if (!self->heads[r] || !self->prev[r]) { PyErr_NoMemory(); return -1; }
        }
    }
    int64_t vote_size = 1;
    while (vote_size < 4 * (int64_t)max_occ) vote_size *= 2;
    self->vote_mask = vote_size - 1;
    self->own_len = PyMem_Malloc(sizeof(int64_t) * max_occ);
    self->own_pos = PyMem_Malloc(sizeof(int64_t) * max_occ);
    self->glob_len = PyMem_Malloc(sizeof(int64_t) * max_occ);
    self->glob_pos = PyMem_Malloc(sizeof(int64_t) * max_occ);
    self->own_next = PyMem_Malloc(sizeof(int32_t) * max_occ);
    self->glob_next = PyMem_Malloc(sizeof(int32_t) * max_occ);
    self->own_src = PyMem_Malloc(sizeof(*self->own_src) * max_occ);
    self->vote_keys = PyMem_Malloc(sizeof(int32_t) * vote_size);
    self->vote_count = PyMem_Malloc(sizeof(int64_t) * vote_size);
    self->vote_order = PyMem_Malloc(sizeof(int32_t) * 2 * max_occ);
    if (!self->own_len || !self->own_pos || !self->glob_len || !self->glob_pos || !self->own_next
        || !self->glob_next || !self->own_src || !self->vote_keys || !self->vote_count || !self->vote_order) {
        PyErr_NoMemory(); return -1;
    }
    memset(self->vote_keys, 0xff, sizeof(int32_t) * vote_size);   /* -1: free */
    return 0;
}

static void Index_dealloc(IndexObject *self) {
    PyMem_Free(self->ring);
    for (int r = 0; r < MAX_ORDERS; r++) { PyMem_Free(self->heads[r]); PyMem_Free(self->prev[r]); }
    PyMem_Free(self->starts);
    PyMem_Free(self->own_len); PyMem_Free(self->own_pos); PyMem_Free(self->glob_len); PyMem_Free(self->glob_pos);
    PyMem_Free(self->own_next); PyMem_Free(self->glob_next); PyMem_Free(self->own_src);
    PyMem_Free(self->vote_keys); PyMem_Free(self->vote_count);
    PyMem_Free(self->vote_order); PyMem_Free(self->draft);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Room for one more start in the deque (grows it when full). */
static int starts_reserve(IndexObject *self) {
    if (self->starts_count < self->starts_cap) return 0;
    int64_t cap = self->starts_cap ? 2 * self->starts_cap : 64;
    int64_t *s = PyMem_Malloc(sizeof(int64_t) * cap);
    if (!s) return -1;
    for (int64_t i = 0; i < self->starts_count; i++) s[i] = self->starts[(self->starts_front + i) % self->starts_cap];
    PyMem_Free(self->starts);
    self->starts = s; self->starts_cap = cap; self->starts_front = 0;
    return 0;
}

static void evict_oldest(IndexObject *self) {
    int64_t start = self->starts[self->starts_front];
    self->starts_front = (self->starts_front + 1) % self->starts_cap;
    self->starts_count--;
    int64_t next = self->starts_count ? self->starts[self->starts_front] : self->end;
    self->tokens -= next - start - 1;
    self->documents--;
    self->evicted++;
    self->base = next;
}

static PyObject *Index_add(IndexObject *self, PyObject *arg) {
    int32_t *buf; Py_ssize_t m;
    if (read_tokens(arg, &buf, &m) < 0) return NULL;
    int64_t cap = self->capacity;
    const int32_t *tok = buf;
    if (m >= cap) { tok = buf + (m - (cap - 1)); m = cap - 1; }   /* keep the last tokens */
    if (cap == 0 || m <= 0) { PyMem_Free(buf); Py_RETURN_NONE; }
    uint64_t *prefix = PyMem_Malloc(sizeof(uint64_t) * (m + 1));
    if (!prefix || starts_reserve(self) < 0) { PyMem_Free(buf); PyMem_Free(prefix); return PyErr_NoMemory(); }
    while (self->end + m + 1 - self->base > cap) evict_oldest(self);
    const Params *pr = &self->params;
    int64_t start = self->end;
    prefix[0] = 0;
    for (Py_ssize_t i = 0; i < m; i++) prefix[i + 1] = prefix[i] * BASE + (uint64_t)tok[i] + 1;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t p = start + i, slot = p % cap;
        self->ring[slot] = tok[i];
        for (int r = 0; r < pr->n_orders; r++) {
            if (i + 1 < pr->orders[r]) continue;
            uint64_t g = prefix[i + 1] - prefix[i + 1 - pr->orders[r]] * pr->powers[r];
            int64_t b = bucket_of(g, self->bits);
            int64_t head = decode_head(self->heads[r][b], p);
            self->prev[r][slot] = head >= self->base ? (uint32_t)(p - head) : 0;
            self->heads[r][b] = (uint32_t)(p + 1);
        }
    }
    self->ring[(start + m) % cap] = SEPARATOR;
    self->end = start + m + 1;
    self->starts[(self->starts_front + self->starts_count++) % self->starts_cap] = start;
    self->documents++;
    self->tokens += m;
    PyMem_Free(prefix);
    PyMem_Free(buf);
    Py_RETURN_NONE;
}

static PyObject *Index_new_context(IndexObject *self, PyObject *Py_UNUSED(ignored)) {
    ContextObject *c = PyObject_New(ContextObject, &ContextType);
    if (!c) return NULL;
    c->n = 0; c->cap = 0; c->bits = 0;
    c->tokens = NULL; c->prefix = NULL;
    for (int r = 0; r < MAX_ORDERS; r++) { c->heads[r] = NULL; c->prev[r] = NULL; }
    Py_INCREF(self);
    c->owner = self;
    if (ctx_reserve(c, 64) < 0 || ctx_set_bits(c, MIN_BITS) < 0) { Py_DECREF(c); return PyErr_NoMemory(); }
    c->prefix[0] = 0;
    return (PyObject *)c;
}

/* Occurrences of q's order-r suffix gram in src's tokens (src == q: its own earlier text; else a
 * peer's), most recent first, each with a next token in src (so q's suffix itself never counts),
 * at most `limit` of them -> how many were written to len_out/pos_out. */
static int ctx_occurrences(const ContextObject *src, const ContextObject *q, int r, int64_t *len_out,
                           int64_t *pos_out, int limit) {
    const Params *pr = &q->owner->params;
    int64_t n = q->n, m = src->n, k = pr->orders[r];
    const int32_t *t = src->tokens, *qt = q->tokens;
    if (n < k || m < k + 1) return 0;
    int64_t p = src->heads[r][bucket_of(ctx_gram_hash(q, r, n), src->bits)];
    int found = 0, steps = 0;
    while (p >= 0 && steps < pr->max_steps && found < limit) {
        steps++;
        if (p < m - 1 && memcmp(t + p - k + 1, qt + n - k, sizeof(int32_t) * k) == 0) {
            int64_t len = k;
            while (len < pr->max_match && len < n && p - len >= 0 && t[p - len] == qt[n - 1 - len]) len++;
            len_out[found] = len; pos_out[found] = p + 1; found++;
        }
        p = src->prev[r][p];
    }
    return found;
}

/* Occurrences of the context's order-r suffix gram in the kept documents, most recent first. */
static int glob_occurrences(const IndexObject *self, const ContextObject *c, int r, int64_t *len_out,
                            int64_t *pos_out) {
    const Params *pr = &self->params;
    int64_t n = c->n, k = pr->orders[r], cap = self->capacity, base = self->base;
    const int32_t *q = c->tokens, *ring = self->ring;
    if (self->documents == 0 || n < k) return 0;
    int64_t p = decode_head(self->heads[r][bucket_of(ctx_gram_hash(c, r, n), self->bits)], self->end);
    int found = 0, steps = 0;
    while (p >= base && steps < pr->max_steps && found < pr->max_occ) {
        steps++;
        if (p - k + 1 >= base && ring[(p + 1) % cap] != SEPARATOR) {
            int64_t j = 0;
            while (j < k && ring[(p - j) % cap] == q[n - 1 - j]) j++;
            if (j == k) {
                int64_t len = k;
                while (len < pr->max_match && len < n && p - len >= base && ring[(p - len) % cap] == q[n - 1 - len])
                    len++;
                len_out[found] = len; pos_out[found] = p + 1; found++;
            }
        }
        uint32_t d = self->prev[r][p % cap];
        if (d == 0) break;
        p -= d;
    }
    return found;
}

/* Keep the occurrences of the longest match length (in order; src, when given, follows pos) ->
 * that length, or -1 if none. */
static int64_t keep_longest(const int64_t *len, int64_t *pos, const ContextObject **src, int *count) {
    int64_t best = -1;
    for (int i = 0; i < *count; i++) if (len[i] > best) best = len[i];
    int kept = 0;
    for (int i = 0; i < *count; i++)
        if (len[i] == best) { if (src) src[kept] = src[i]; pos[kept++] = pos[i]; }
    *count = kept;
    return best;
}

/* Add one vote for token t to the table; -> its entry. */
static inline int64_t vote_slot(IndexObject *self, int32_t t, int *distinct) {
    int64_t s = ((uint64_t)(uint32_t)t * MIX) >> 40 & self->vote_mask;
    while (self->vote_keys[s] != t) {
        if (self->vote_keys[s] == -1) {
            self->vote_keys[s] = t; self->vote_count[s] = 0;
            self->vote_order[(*distinct)++] = (int32_t)s;
            break;
        }
        s = (s + 1) & self->vote_mask;
    }
    return s;
}

static PyObject *Index_propose(IndexObject *self, PyObject *args) {
    ContextObject *c; int max_tokens; double min_confidence; PyObject *peer_arg = NULL, *uniform_arg = NULL;
    if (!PyArg_ParseTuple(args, "O!id|OO", &ContextType, &c, &max_tokens, &min_confidence, &peer_arg, &uniform_arg))
        return NULL;
    if (c->owner != self) {
        PyErr_SetString(PyExc_ValueError, "the context was made by another index (use that index's new_request())");
        return NULL;
    }
    /* sampled drafts: token j is drawn from the votes with uniforms[j] (inverse CDF, first-seen order) */
    PyObject *uniforms = NULL, *votes = NULL;
    if (uniform_arg && uniform_arg != Py_None) {
        uniforms = PySequence_Fast(uniform_arg, "uniforms must be a sequence of floats");
        if (!uniforms) return NULL;
        if (PySequence_Fast_GET_SIZE(uniforms) < max_tokens) {
            Py_DECREF(uniforms);
            PyErr_SetString(PyExc_ValueError, "uniforms must hold at least max_tokens floats");
            return NULL;
        }
        votes = PyList_New(0);
        if (!votes) { Py_DECREF(uniforms); return NULL; }
    }
    PyObject *peers = peer_arg && peer_arg != Py_None ? PySequence_Fast(peer_arg, "peers must be a sequence of contexts")
                                                      : PyTuple_New(0);
    if (!peers) { Py_XDECREF(uniforms); Py_XDECREF(votes); return NULL; }
    Py_ssize_t n_peers = PySequence_Fast_GET_SIZE(peers);
    PyObject **peer_items = PySequence_Fast_ITEMS(peers);
    for (Py_ssize_t i = 0; i < n_peers; i++) {
        if (!PyObject_TypeCheck(peer_items[i], &ContextType) || ((ContextObject *)peer_items[i])->owner != self) {
            Py_DECREF(peers); Py_XDECREF(uniforms); Py_XDECREF(votes);
            PyErr_SetString(PyExc_ValueError, "peers must be contexts made by this index's new_request()");
            return NULL;
        }
    }
    const Params *pr = &self->params;
    /* match: each source's longest (the own source: the request's text, then its peers'); the
     * longer (own + own_bonus) wins, both on a tie */
    int n_own = 0, n_glob = 0;
    for (int r = pr->n_orders - 1; r >= 0 && n_own == 0; r--) {
        n_own = ctx_occurrences(c, c, r, self->own_len, self->own_pos, pr->max_occ);
        for (int i = 0; i < n_own; i++) self->own_src[i] = c;
        for (Py_ssize_t j = 0; j < n_peers && n_own < pr->max_occ; j++) {
            const ContextObject *peer = (const ContextObject *)peer_items[j];
            if (peer == c) continue;
            int got = ctx_occurrences(peer, c, r, self->own_len + n_own, self->own_pos + n_own, pr->max_occ - n_own);
            for (int i = n_own; i < n_own + got; i++) self->own_src[i] = peer;
            n_own += got;
        }
    }
    for (int r = pr->n_orders - 1; r >= 0 && n_glob == 0; r--)
        n_glob = glob_occurrences(self, c, r, self->glob_len, self->glob_pos);
    int64_t own_best = keep_longest(self->own_len, self->own_pos, self->own_src, &n_own);
    int64_t glob_best = keep_longest(self->glob_len, self->glob_pos, NULL, &n_glob);
    if (n_own) own_best += pr->own_bonus;
    if (own_best < glob_best) n_own = 0;
    if (glob_best < own_best) n_glob = 0;
    /* the longest match among the voting sources, in context tokens (the own bonus left out) */
    const int64_t match = n_glob ? glob_best : n_own ? own_best - pr->own_bonus : 0;
    const int own = n_own > 0;
    if (max_tokens > self->draft_cap) {
        int32_t *d = PyMem_Realloc(self->draft, sizeof(int32_t) * max_tokens);
        if (!d) { Py_DECREF(peers); Py_XDECREF(uniforms); Py_XDECREF(votes); return PyErr_NoMemory(); }
        self->draft = d; self->draft_cap = max_tokens;
    }
    PyObject *confidences = PyList_New(0);
    if (!confidences) { Py_DECREF(peers); Py_XDECREF(uniforms); Py_XDECREF(votes); return NULL; }
    int64_t n = c->n, cap = self->capacity;
    int K = 0, distinct = 0;
    double product = 1.0;
    PyObject *step_votes = NULL;
    while (K < max_tokens && n_own + n_glob > 0) {   /* draft: vote, keep the agreeing occurrences */
        distinct = 0;
        for (int i = 0; i < n_own; i++) {   /* the request's own text runs on into the draft; a peer's ends */
            int64_t q = self->own_pos[i];
            const ContextObject *src = self->own_src[i];
            int32_t t = src == c ? (q < n ? c->tokens[q] : self->draft[q - n]) : (q < src->n ? src->tokens[q] : SEPARATOR);
            self->own_next[i] = t;
            if (t != SEPARATOR) self->vote_count[vote_slot(self, t, &distinct)]++;
        }
        for (int i = 0; i < n_glob; i++) {
            int32_t t = self->ring[self->glob_pos[i] % cap];
            self->glob_next[i] = t;
            if (t != SEPARATOR) self->vote_count[vote_slot(self, t, &distinct)]++;
        }
        if (distinct == 0) break;
        int64_t total = 0, best_votes = 0;
        int32_t best = -1;
        for (int i = 0; i < distinct; i++) {   /* the first of the most voted, in first-seen order */
            int64_t s = self->vote_order[i];
            total += self->vote_count[s];
            if (self->vote_count[s] > best_votes) { best = self->vote_keys[s]; best_votes = self->vote_count[s]; }
        }
        if (uniforms) {   /* draw instead: the first token whose running count passes u * total */
            double u = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(uniforms, K));
            if (u == -1.0 && PyErr_Occurred()) goto fail;
            double bar = u * (double)total, seen = 0;
            best = -1;
            step_votes = PyTuple_New(2);
            PyObject *ids = PyList_New(distinct), *shares = PyList_New(distinct);
            if (step_votes) { PyTuple_SET_ITEM(step_votes, 0, ids); PyTuple_SET_ITEM(step_votes, 1, shares); }
            else { Py_XDECREF(ids); Py_XDECREF(shares); }
            if (!step_votes || !ids || !shares) goto fail;
            for (int i = 0; i < distinct; i++) {
                int64_t s = self->vote_order[i];
                seen += (double)self->vote_count[s];
                if (best < 0 && (seen > bar || i == distinct - 1)) { best = self->vote_keys[s]; best_votes = self->vote_count[s]; }
                PyObject *id = PyLong_FromLong(self->vote_keys[s]);
                PyObject *share = PyFloat_FromDouble((double)self->vote_count[s] / (double)total);
                if (!id || !share) { Py_XDECREF(id); Py_XDECREF(share); goto fail; }
                PyList_SET_ITEM(ids, i, id); PyList_SET_ITEM(shares, i, share);
            }
        }
        for (int i = 0; i < distinct; i++) self->vote_keys[self->vote_order[i]] = -1;   /* clear the table */
        double confidence = (double)best_votes / (double)total;
        product *= confidence;
        if (product < min_confidence) { Py_XDECREF(step_votes); step_votes = NULL; break; }
        PyObject *f = PyFloat_FromDouble(confidence);
        if (!f || PyList_Append(confidences, f) < 0) { Py_XDECREF(f); goto fail; }
        Py_DECREF(f);
        if (step_votes) {
            int bad = PyList_Append(votes, step_votes);
            Py_DECREF(step_votes);
            step_votes = NULL;
            if (bad < 0) goto fail;
        }
        self->draft[K++] = best;
        int kept = 0;
        for (int i = 0; i < n_own; i++)
            if (self->own_next[i] == best) { self->own_src[kept] = self->own_src[i]; self->own_pos[kept++] = self->own_pos[i] + 1; }
        n_own = kept; kept = 0;
        for (int i = 0; i < n_glob; i++) if (self->glob_next[i] == best) self->glob_pos[kept++] = self->glob_pos[i] + 1;
        n_glob = kept;
    }
    Py_DECREF(peers);
    Py_XDECREF(uniforms);
    PyObject *tokens = PyList_New(K);
    if (!tokens) { Py_DECREF(confidences); Py_XDECREF(votes); return NULL; }
    for (int i = 0; i < K; i++) PyList_SET_ITEM(tokens, i, PyLong_FromLong(self->draft[i]));
    if (!votes) { votes = Py_None; Py_INCREF(votes); }
    return Py_BuildValue("(NNLNN)", tokens, confidences, (long long)match, PyBool_FromLong(own), votes);
fail:   /* an error while drafting: the vote table is cleared, every reference dropped */
    for (int i = 0; i < distinct; i++) self->vote_keys[self->vote_order[i]] = -1;
    Py_XDECREF(step_votes); Py_DECREF(confidences); Py_DECREF(peers); Py_XDECREF(uniforms); Py_XDECREF(votes);
    return NULL;
}

static PyMethodDef Index_methods[] = {
    {"add", (PyCFunction)Index_add, METH_O, "add(tokens): append one document, evicting the oldest as needed."},
    {"new_context", (PyCFunction)Index_new_context, METH_NOARGS, "new_context() -> an empty request Context."},
    {"propose", (PyCFunction)Index_propose, METH_VARARGS,
     "propose(ctx, max_tokens, min_confidence, peers=(), uniforms=None) -> (token ids, confidences, match length, own,"
     " votes): with uniforms, each token drawn from the votes, votes[j] = (ids, shares) of step j; else None."},
    {NULL},
};

static PyMemberDef Index_members[] = {
    {"documents", T_LONGLONG, offsetof(IndexObject, documents), READONLY, "documents kept"},
    {"tokens", T_LONGLONG, offsetof(IndexObject, tokens), READONLY, "tokens kept (separators not counted)"},
    {"evicted", T_LONGLONG, offsetof(IndexObject, evicted), READONLY, "documents evicted since start"},
    {NULL},
};

static PyTypeObject IndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "specrl.speculation._suffix_index.Index",
    .tp_doc = "Index(capacity, min_match, max_match, max_occurrences, own_bonus): see specrl.speculation.suffix_index.",
    .tp_basicsize = sizeof(IndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Index_init,
    .tp_dealloc = (destructor)Index_dealloc,
    .tp_methods = Index_methods,
    .tp_members = Index_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_suffix_index",
    .m_doc = "C core of specrl.speculation.suffix_index (see its docstring).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__suffix_index(void) {
    if (PyType_Ready(&IndexType) < 0 || PyType_Ready(&ContextType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&IndexType);
    Py_INCREF(&ContextType);
    if (PyModule_AddObject(m, "Index", (PyObject *)&IndexType) < 0
        || PyModule_AddObject(m, "Context", (PyObject *)&ContextType) < 0) return NULL;
    return m;
}
