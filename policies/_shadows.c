/* The adaptive policy's referee shadows in C: the same decisions as policies/adaptive.py's
 * _ShadowLRU, _ShadowARC and _GhostShadows (its _ShadowLiveARCs and their _GhostReferee),
 * at a fraction of their cost per request.
 *
 * Why: every sampled request is replayed in each shadow (two for `adaptive`, five for
 * `adaptive-ghosts`), on vLLM's scheduler thread. In Python the ghost shadows and their
 * referee cost about a tenth of the manager's calls/s as vLLM drives it, more than the
 * margin over twice vLLM `arc`'s; here a sampled request is one call per referee.
 *
 * The Python classes stay the reference: tests/policies/test_shadows.py holds each type here
 * in lockstep with its twin (hits, target p, lists, ghosts and the referee's counts after
 * every request), and policies/adaptive.py falls back to them where this was not built.
 *
 * One table per shadow: a pool of nodes (key, hash, list links, hash chain), sized at
 * construction to the most keys the shadow can hold, a chained hash index over them, and up
 * to four doubly linked lists. A key is in one list at most, as in the Python shadows (a
 * resident key is never a ghost). Keys are held by reference; equality is a byte compare for
 * exact bytes keys (kvtier's), Python's == otherwise (the simulator's int keys). Keys are
 * bytes or ints, which hold no references, so the types do not take part in cyclic GC.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#if PY_VERSION_HEX < 0x030C0000 /* 3.11: the member flags' older names */
#include <structmember.h>
#define Py_T_PYSSIZET T_PYSSIZET
#define Py_T_DOUBLE T_DOUBLE
#define Py_T_INT T_INT
#define Py_READONLY READONLY
#endif

#define NIL (-1)
#define MAX_LISTS 4

typedef struct {
    PyObject *key; /* owned while in use */
    Py_hash_t hash;
    Py_ssize_t prev, next; /* the node's list */
    Py_ssize_t chain;      /* the next node in its hash bucket; the free list's link */
    signed char list;
    char mark; /* a ghost's mark: it left T2 */
} Node;

typedef struct {
    Py_ssize_t head, tail, len, marked;
} List;

typedef struct {
    Node *nodes;
    Py_ssize_t *buckets;
    size_t mask;
    Py_ssize_t free_head;
    List lists[MAX_LISTS];
} Table;

static int
table_init(Table *t, Py_ssize_t max_nodes)
{
    size_t n_buckets = 8;
    while (n_buckets < (size_t)max_nodes * 2)
        n_buckets <<= 1;
    t->nodes = PyMem_Calloc((size_t)max_nodes, sizeof(Node));
    t->buckets = PyMem_Malloc(n_buckets * sizeof(Py_ssize_t));
    if (t->nodes == NULL || t->buckets == NULL) {
        PyMem_Free(t->nodes);
        PyMem_Free(t->buckets);
        t->nodes = NULL;
        t->buckets = NULL;
        PyErr_NoMemory();
        return -1;
    }
    t->mask = n_buckets - 1;
    for (size_t i = 0; i < n_buckets; i++)
        t->buckets[i] = NIL;
    for (Py_ssize_t i = 0; i < max_nodes; i++)
        t->nodes[i].chain = i + 1 < max_nodes ? i + 1 : NIL;
    t->free_head = max_nodes ? 0 : NIL;
    for (int l = 0; l < MAX_LISTS; l++)
        t->lists[l] = (List){NIL, NIL, 0, 0};
    return 0;
}

/* The node holding `key`, NIL if none, -2 if comparing keys raised. */
static Py_ssize_t
table_find(Table *t, PyObject *key, Py_hash_t hash)
{
    Py_ssize_t i = t->buckets[(size_t)hash & t->mask];
    int exact_bytes = PyBytes_CheckExact(key);
    while (i != NIL) {
        Node *n = &t->nodes[i];
        if (n->hash == hash) {
            if (n->key == key)
                return i;
            if (exact_bytes && PyBytes_CheckExact(n->key)) {
                Py_ssize_t size = PyBytes_GET_SIZE(key);
                if (PyBytes_GET_SIZE(n->key) == size &&
                    memcmp(PyBytes_AS_STRING(n->key), PyBytes_AS_STRING(key), (size_t)size) == 0)
                    return i;
            }
            else {
                int equal = PyObject_RichCompareBool(n->key, key, Py_EQ);
                if (equal < 0)
                    return -2;
                if (equal)
                    return i;
            }
        }
        i = n->chain;
    }
    return NIL;
}

static void
list_unlink(Table *t, Py_ssize_t i)
{
    Node *n = &t->nodes[i];
    List *l = &t->lists[n->list];
    if (n->prev != NIL)
        t->nodes[n->prev].next = n->next;
    else
        l->head = n->next;
    if (n->next != NIL)
        t->nodes[n->next].prev = n->prev;
    else
        l->tail = n->prev;
    l->len--;
    l->marked -= n->mark;
}

static void
list_append(Table *t, Py_ssize_t i, int list, char mark)
{
    Node *n = &t->nodes[i];
    List *l = &t->lists[list];
    n->list = (signed char)list;
    n->mark = mark;
    n->next = NIL;
    n->prev = l->tail;
    if (l->tail != NIL)
        t->nodes[l->tail].next = i;
    else
        l->head = i;
    l->tail = i;
    l->len++;
    l->marked += mark;
}

/* Move node `i` to the end of `list` (its own, or another). */
static void
table_move(Table *t, Py_ssize_t i, int list, char mark)
{
    list_unlink(t, i);
    list_append(t, i, list, mark);
}

/* A new node for `key` at the end of `list`; the table is sized so one is always free. */
static void
table_add(Table *t, PyObject *key, Py_hash_t hash, int list, char mark)
{
    Py_ssize_t i = t->free_head;
    Node *n = &t->nodes[i];
    t->free_head = n->chain;
    Py_INCREF(key);
    n->key = key;
    n->hash = hash;
    Py_ssize_t *bucket = &t->buckets[(size_t)hash & t->mask];
    n->chain = *bucket;
    *bucket = i;
    list_append(t, i, list, mark);
}

static void
table_remove(Table *t, Py_ssize_t i)
{
    Node *n = &t->nodes[i];
    list_unlink(t, i);
    Py_ssize_t *link = &t->buckets[(size_t)n->hash & t->mask];
    while (*link != i)
        link = &t->nodes[*link].chain;
    *link = n->chain;
    PyObject *key = n->key;
    n->key = NULL;
    n->chain = t->free_head;
    t->free_head = i;
    Py_DECREF(key);
}

static void
table_clear_list(Table *t, int list)
{
    if (t->nodes == NULL) /* __init__ never ran (or failed): nothing to clear */
        return;
    while (t->lists[list].head != NIL)
        table_remove(t, t->lists[list].head);
}

static void
table_free(Table *t)
{
    if (t->nodes != NULL)
        for (int l = 0; l < MAX_LISTS; l++)
            table_clear_list(t, l);
    PyMem_Free(t->nodes);
    PyMem_Free(t->buckets);
    t->nodes = NULL;
    t->buckets = NULL;
}

static PyObject *
list_keys(Table *t, int list, int with_marks)
{
    PyObject *out = PyList_New(0);
    if (out == NULL || t->nodes == NULL)
        return out;
    for (Py_ssize_t i = t->lists[list].head; i != NIL; i = t->nodes[i].next) {
        Node *n = &t->nodes[i];
        PyObject *item = with_marks ? Py_BuildValue("(OO)", n->key, n->mark ? Py_True : Py_False) : Py_NewRef(n->key);
        if (item == NULL || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* `key`'s node (NIL if none) and its hash, in a table whose __init__ has run; -2 with an
   error set. */
static Py_ssize_t
table_lookup(Table *t, PyObject *key, Py_hash_t *hash)
{
    if (t->nodes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shadow used before __init__");
        return -2;
    }
    if ((*hash = PyObject_Hash(key)) == -1)
        return -2;
    return table_find(t, key, *hash);
}

static int
capacity_arg(Py_ssize_t capacity)
{
    if (capacity < 1) {
        PyErr_Format(PyExc_ValueError, "capacity must be at least 1, got %zd", capacity);
        return -1;
    }
    return 0;
}

/* __init__(capacity) of a shadow whose table holds up to `per_row * capacity + extra` keys. */
static int
init_with_capacity(Table *t, Py_ssize_t *capacity, PyObject *args, PyObject *kwargs, Py_ssize_t per_row,
                   Py_ssize_t extra)
{
    static char *names[] = {"capacity", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n", names, capacity) || capacity_arg(*capacity) < 0)
        return -1;
    table_free(t);
    return table_init(t, per_row * *capacity + extra);
}

/* ---- LRU --------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Table table;
    Py_ssize_t capacity;
} ShadowLRU;

static int
lru_init(ShadowLRU *self, PyObject *args, PyObject *kwargs)
{
    return init_with_capacity(&self->table, &self->capacity, args, kwargs, 1, 1);
}

static PyObject *
lru_request(ShadowLRU *self, PyObject *key)
{
    Table *t = &self->table;
    Py_hash_t hash;
    Py_ssize_t i = table_lookup(t, key, &hash);
    if (i == -2)
        return NULL;
    if (i != NIL) {
        table_move(t, i, 0, 0);
        Py_RETURN_TRUE;
    }
    if (t->lists[0].len >= self->capacity)
        table_remove(t, t->lists[0].head);
    table_add(t, key, hash, 0, 0);
    Py_RETURN_FALSE;
}

static PyObject *
lru_keys(ShadowLRU *self, PyObject *Py_UNUSED(ignored))
{
    return list_keys(&self->table, 0, 0);
}

static PyObject *
lru_clear(ShadowLRU *self, PyObject *Py_UNUSED(ignored))
{
    table_clear_list(&self->table, 0);
    Py_RETURN_NONE;
}

/* ---- ARC (the paper's, as _ShadowARC) -------------------------------------------------- */

enum { T1, T2, B1, B2 };

/* ARC's hit (both ARCs here): node `i` (NIL: no node) in T1 or T2 moves to T2's end.
   Whether it was resident. */
static int
arc_hit(Table *t, Py_ssize_t i)
{
    if (i == NIL || (t->nodes[i].list != T1 && t->nodes[i].list != T2))
        return 0;
    table_move(t, i, T2, 0);
    return 1;
}

/* Whether ARC's victim is T1's oldest: while |T1| > p, or when T2 is empty. */
static int
victim_from_t1(List *l, double p)
{
    return l[T1].len && ((double)l[T1].len > p || !l[T2].len);
}

/* ARC's target after a ghost hit: up by max(1, `ratio`) to `capacity` (a ghost of T1), or
   down by it to 0 (of T2); as policies.adaptive._target_after_ghost and ARCPolicy do. */
static double
target_after_ghost(double p, int from_t2, double ratio, double capacity)
{
    double step = ratio > 1.0 ? ratio : 1.0;
    if (from_t2)
        return p - step > 0.0 ? p - step : 0.0;
    return p + step < capacity ? p + step : capacity;
}

typedef struct {
    PyObject_HEAD
    Table table;
    Py_ssize_t capacity;
    double p;
} ShadowARC;

static int
arc_init(ShadowARC *self, PyObject *args, PyObject *kwargs)
{
    self->p = 0.0;
    return init_with_capacity(&self->table, &self->capacity, args, kwargs, 2, 2);
}

static PyObject *
arc_request(ShadowARC *self, PyObject *key)
{
    Table *t = &self->table;
    List *l = t->lists;
    Py_ssize_t capacity = self->capacity;
    Py_hash_t hash;
    Py_ssize_t i = table_lookup(t, key, &hash);
    if (i == -2)
        return NULL;
    if (arc_hit(t, i))
        Py_RETURN_TRUE;
    if (l[T1].len + l[T2].len >= capacity) {
        if (victim_from_t1(l, self->p))
            table_move(t, l[T1].head, B1, 0);
        else
            table_move(t, l[T2].head, B2, 0);
        /* a trim may forget the requested key's own ghost (the oldest of its list): then it
           comes in as new, as in _ShadowARC, where the ghost test follows the trims */
        if (l[B1].len && l[T1].len + l[B1].len > capacity) {
            if (l[B1].head == i)
                i = NIL;
            table_remove(t, l[B1].head);
        }
        if (l[T1].len + l[T2].len + l[B1].len + l[B2].len > 2 * capacity) {
            int from = l[B2].len ? B2 : B1;
            if (l[from].head == i)
                i = NIL;
            table_remove(t, l[from].head);
        }
    }
    if (i != NIL) { /* back from B1 or B2: ARC's ghost rule, by the two lists' sizes */
        int from_t2 = t->nodes[i].list == B2;
        double ratio = from_t2 ? (double)l[B1].len / (double)l[B2].len : (double)l[B2].len / (double)l[B1].len;
        self->p = target_after_ghost(self->p, from_t2, ratio, (double)capacity);
        table_move(t, i, T2, 0);
    }
    else
        table_add(t, key, hash, T1, 0);
    Py_RETURN_FALSE;
}

static PyObject *
arc_lists(ShadowARC *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *parts[4] = {NULL, NULL, NULL, NULL};
    for (int l = 0; l < 4; l++)
        if ((parts[l] = list_keys(&self->table, l, 0)) == NULL)
            goto fail;
    return Py_BuildValue("(NNNN)", parts[0], parts[1], parts[2], parts[3]);
fail:
    for (int l = 0; l < 4; l++)
        Py_XDECREF(parts[l]);
    return NULL;
}

static PyObject *
arc_clear(ShadowARC *self, PyObject *Py_UNUSED(ignored))
{
    for (int l = 0; l < 4; l++)
        table_clear_list(&self->table, l);
    self->p = 0.0;
    Py_RETURN_NONE;
}

/* ---- the live ARC (adaptive's own, with ghost generations; as _ShadowLiveARC) ---------- */

typedef struct {
    Table table;
    Py_ssize_t capacity, generation;
    int young; /* the list (2 or 3) taking victims; the other is the older generation */
    double p;
} LiveARC;

/* Replay one request: 1 hit, 0 miss, -1 error. */
static int
live_request(LiveARC *s, PyObject *key, Py_hash_t hash)
{
    Table *t = &s->table;
    List *l = t->lists;
    Py_ssize_t i = table_find(t, key, hash);
    if (i == -2)
        return -1;
    if (arc_hit(t, i))
        return 1;
    int young = s->young, old = 5 - young;
    if (l[T1].len + l[T2].len >= s->capacity) {
        if (victim_from_t1(l, s->p))
            table_move(t, l[T1].head, young, 0);
        else
            table_move(t, l[T2].head, young, 1);
        if (l[young].len >= s->generation) { /* the younger generation ages; the older goes */
            if (i != NIL && t->nodes[i].list == old)
                i = NIL;
            table_clear_list(t, old);
            s->young = old;
        }
    }
    if (i == NIL) {
        table_add(t, key, hash, T1, 0);
        return 0;
    }
    char mark = t->nodes[i].mark;
    table_remove(t, i); /* its ghost, then a fresh node in T2: the count below is without it */
    Py_ssize_t ghosts = l[2].len + l[3].len, b2 = l[2].marked + l[3].marked;
    double ratio = mark ? (double)(ghosts - b2) / (double)(b2 + 1) : (double)b2 / (double)(ghosts - b2 + 1);
    s->p = target_after_ghost(s->p, mark, ratio, (double)s->capacity);
    table_add(t, key, hash, T2, 0);
    return 0;
}

static PyObject *
live_state(LiveARC *s)
{
    Table *t = &s->table;
    PyObject *t1 = list_keys(t, T1, 0), *t2 = list_keys(t, T2, 0);
    PyObject *ghosts = list_keys(t, s->young, 1), *ghosts_old = list_keys(t, 5 - s->young, 1);
    if (t1 == NULL || t2 == NULL || ghosts == NULL || ghosts_old == NULL) {
        Py_XDECREF(t1);
        Py_XDECREF(t2);
        Py_XDECREF(ghosts);
        Py_XDECREF(ghosts_old);
        return NULL;
    }
    return Py_BuildValue("((NNNN)d)", t1, t2, ghosts, ghosts_old, s->p);
}

/* ---- the ghost shadows and their referee (as _GhostShadows) ------------------------------- */

typedef struct {
    PyObject_HEAD
    LiveARC *shadows;
    int n, current;
    double scale, switch_z2;
    double *leads, *apart;
    char *hits;
} GhostShadows;

static void
ghosts_free(GhostShadows *self)
{
    if (self->shadows != NULL)
        for (int k = 0; k < self->n; k++)
            table_free(&self->shadows[k].table);
    PyMem_Free(self->shadows);
    PyMem_Free(self->leads);
    PyMem_Free(self->apart);
    PyMem_Free(self->hits);
    self->shadows = NULL;
    self->leads = self->apart = NULL;
    self->hits = NULL;
    self->n = 0;
}

static int
ghosts_init(GhostShadows *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "generations", "current", "switch_z2", NULL};
    Py_ssize_t capacity;
    PyObject *generations;
    int current;
    double switch_z2;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nOid", names, &capacity, &generations, &current, &switch_z2) ||
        capacity_arg(capacity) < 0)
        return -1;
    PyObject *sizes = PySequence_Fast(generations, "generations must be a sequence of ints");
    if (sizes == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(sizes);
    if (n < 1 || n > 64 || current < 0 || current >= n) {
        PyErr_Format(PyExc_ValueError, "need 1 to 64 generations and current among them, got %zd and %d", n, current);
        Py_DECREF(sizes);
        return -1;
    }
    ghosts_free(self);
    self->shadows = PyMem_Calloc((size_t)n, sizeof(LiveARC));
    self->leads = PyMem_Calloc((size_t)n, sizeof(double));
    self->apart = PyMem_Calloc((size_t)n, sizeof(double));
    self->hits = PyMem_Calloc((size_t)n, 1);
    if (self->shadows == NULL || self->leads == NULL || self->apart == NULL || self->hits == NULL) {
        ghosts_free(self);
        Py_DECREF(sizes);
        PyErr_NoMemory();
        return -1;
    }
    self->n = (int)n;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t generation = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(sizes, k));
        if (generation < 1) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "a generation must be at least 1, got %zd", generation);
            ghosts_free(self);
            Py_DECREF(sizes);
            return -1;
        }
        LiveARC *s = &self->shadows[k];
        s->capacity = capacity;
        s->generation = generation;
        s->young = 2;
        if (table_init(&s->table, capacity + 2 * generation + 2) < 0) {
            ghosts_free(self);
            Py_DECREF(sizes);
            return -1;
        }
    }
    Py_DECREF(sizes);
    self->current = current;
    self->scale = 1.0;
    self->switch_z2 = switch_z2;
    return 0;
}

/* One sampled request in every shadow, then _GhostReferee.request on their hits. */
static PyObject *
ghosts_request(GhostShadows *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "request(key, decay)");
        return NULL;
    }
    if (self->shadows == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shadow used before __init__");
        return NULL;
    }
    double decay = PyFloat_AsDouble(args[1]);
    if (decay == -1.0 && PyErr_Occurred())
        return NULL;
    Py_hash_t hash = PyObject_Hash(args[0]);
    if (hash == -1)
        return NULL;
    int n = self->n, all_hit = 1, none_hit = 1;
    char *hits = self->hits;
    for (int k = 0; k < n; k++) {
        int hit = live_request(&self->shadows[k], args[0], hash);
        if (hit < 0)
            return NULL;
        hits[k] = (char)hit;
        all_hit &= hit;
        none_hit &= !hit;
    }
    double *leads = self->leads, *apart = self->apart;
    double scale = self->scale = self->scale / decay; /* the decay, applied lazily */
    if (scale > 1e100) {
        for (int k = 0; k < n; k++) {
            leads[k] = leads[k] / scale;
            apart[k] = apart[k] / scale;
        }
        self->scale = scale = 1.0;
    }
    if (all_hit || none_hit)
        Py_RETURN_NONE;
    char hit = hits[self->current];
    int best = -1;
    double best_lead = 0.0;
    for (int k = 0; k < n; k++) {
        if (hits[k] == hit)
            continue;
        apart[k] += scale;
        leads[k] += hits[k] ? scale : -scale;
        double lead = leads[k];
        if (hits[k] && lead > best_lead && lead * lead > self->switch_z2 * apart[k] * scale) {
            best = k;
            best_lead = lead;
        }
    }
    if (best < 0)
        Py_RETURN_NONE;
    self->current = best;
    for (int k = 0; k < n; k++) {
        leads[k] = leads[k] - best_lead;
        apart[k] = 0.0;
    }
    return PyLong_FromLong(best);
}

static PyObject *
ghosts_state(GhostShadows *self, PyObject *Py_UNUSED(ignored))
{
    int n = self->n;
    PyObject *leads = PyList_New(n), *apart = PyList_New(n), *shadows = PyList_New(n);
    if (leads == NULL || apart == NULL || shadows == NULL)
        goto fail;
    for (int k = 0; k < n; k++) {
        PyObject *lead = PyFloat_FromDouble(self->leads[k]), *a = PyFloat_FromDouble(self->apart[k]);
        PyObject *shadow = live_state(&self->shadows[k]);
        if (lead == NULL || a == NULL || shadow == NULL) {
            Py_XDECREF(lead);
            Py_XDECREF(a);
            Py_XDECREF(shadow);
            goto fail;
        }
        PyList_SET_ITEM(leads, k, lead);
        PyList_SET_ITEM(apart, k, a);
        PyList_SET_ITEM(shadows, k, shadow);
    }
    return Py_BuildValue("(idNNN)", self->current, self->scale, leads, apart, shadows);
fail:
    Py_XDECREF(leads);
    Py_XDECREF(apart);
    Py_XDECREF(shadows);
    return NULL;
}

/* ---- the types ------------------------------------------------------------------------- */

#define DEALLOC(name, type)                         \
    static void name(type *self)                    \
    {                                               \
        table_free(&self->table);                   \
        Py_TYPE(self)->tp_free((PyObject *)self);   \
    }
DEALLOC(lru_dealloc, ShadowLRU)
DEALLOC(arc_dealloc, ShadowARC)

static void
ghosts_dealloc(GhostShadows *self)
{
    ghosts_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef lru_methods[] = {
    {"request", (PyCFunction)lru_request, METH_O, "Replay one request; whether it hit."},
    {"keys", (PyCFunction)lru_keys, METH_NOARGS, "Resident keys, least recent first."},
    {"clear", (PyCFunction)lru_clear, METH_NOARGS, "Forget every key."},
    {NULL},
};
static PyMethodDef arc_methods[] = {
    {"request", (PyCFunction)arc_request, METH_O, "Replay one request; whether it hit."},
    {"lists", (PyCFunction)arc_lists, METH_NOARGS, "(T1, T2, B1, B2), each oldest first."},
    {"clear", (PyCFunction)arc_clear, METH_NOARGS, "Forget every key; p back to 0."},
    {NULL},
};
static PyMethodDef ghosts_methods[] = {
    {"request", (PyCFunction)(void (*)(void))ghosts_request, METH_FASTCALL,
     "request(key, decay): replay one sampled request in every shadow; the shadow to follow "
     "now if it changed, else None."},
    {"state", (PyCFunction)ghosts_state, METH_NOARGS,
     "(current, scale, leads, apart, [((T1, T2, younger ghosts, older ghosts), p) per shadow])."},
    {NULL},
};

static PyObject *
lru_len(ShadowLRU *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->table.lists[0].len);
}

static PyMemberDef lru_members[] = {
    {"capacity", Py_T_PYSSIZET, offsetof(ShadowLRU, capacity), Py_READONLY, NULL},
    {NULL},
};
static PyGetSetDef lru_getset[] = {
    {"resident", (getter)lru_len, NULL, "Keys held.", NULL},
    {NULL},
};
static PyMemberDef arc_members[] = {
    {"capacity", Py_T_PYSSIZET, offsetof(ShadowARC, capacity), Py_READONLY, NULL},
    {"p", Py_T_DOUBLE, offsetof(ShadowARC, p), Py_READONLY, "ARC's target size of T1."},
    {NULL},
};
static PyMemberDef ghosts_members[] = {
    {"current", Py_T_INT, offsetof(GhostShadows, current), Py_READONLY, "The shadow followed now."},
    {NULL},
};

static PyTypeObject ShadowLRUType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "policies._shadows.ShadowLRU",
    .tp_doc = "LRU of `capacity` keys: request() is a whole request (hit, or evict and insert).",
    .tp_basicsize = sizeof(ShadowLRU),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lru_init,
    .tp_dealloc = (destructor)lru_dealloc,
    .tp_methods = lru_methods,
    .tp_members = lru_members,
    .tp_getset = lru_getset,
};
static PyTypeObject ShadowARCType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "policies._shadows.ShadowARC",
    .tp_doc = "The paper's ARC of `capacity` keys, as policies.adaptive._ShadowARC decides.",
    .tp_basicsize = sizeof(ShadowARC),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)arc_init,
    .tp_dealloc = (destructor)arc_dealloc,
    .tp_methods = arc_methods,
    .tp_members = arc_members,
};
static PyTypeObject GhostShadowsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "policies._shadows.GhostShadows",
    .tp_doc = "adaptive's own ARC at one ghost generation size per shadow, and the referee "
              "choosing among them, as policies.adaptive._GhostShadows decides.",
    .tp_basicsize = sizeof(GhostShadows),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ghosts_init,
    .tp_dealloc = (destructor)ghosts_dealloc,
    .tp_methods = ghosts_methods,
    .tp_members = ghosts_members,
};

static struct PyModuleDef shadows_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "policies._shadows",
    .m_doc = "The adaptive policy's referee shadows, compiled (policies/adaptive.py has the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__shadows(void)
{
    PyTypeObject *types[] = {&ShadowLRUType, &ShadowARCType, &GhostShadowsType};
    const char *names[] = {"ShadowLRU", "ShadowARC", "GhostShadows"};
    PyObject *module = PyModule_Create(&shadows_module);
    if (module == NULL)
        return NULL;
    for (int k = 0; k < 3; k++)
        if (PyType_Ready(types[k]) < 0 || PyModule_AddObjectRef(module, names[k], (PyObject *)types[k]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    return module;
}
