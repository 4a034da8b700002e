/* The adaptive policies' referees in C: the same decisions as policies/adaptive.py's
 * _ExpertReferee (its _ShadowLRU and _ShadowARC, and the switch test between them) and
 * _GhostShadows (its _ShadowLiveARCs and their _GhostReferee), at a fraction of their cost.
 *
 * Why: every sampled request is replayed in each shadow (two for `adaptive`, five for
 * `adaptive-ghosts`) and scored, on vLLM's scheduler thread. In Python the scoring alone
 * cost about as much as both shadows' replays; here a sampled request is one call per
 * referee.
 *
 * The Python classes stay the reference: tests/policies/test_shadows.py holds each type here
 * in lockstep with its twin (what request returns, every list and ghost, targets and the
 * referees' counts, after every request), and policies/adaptive.py falls back to them where
 * this was not built.
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

static int
capacity_arg(Py_ssize_t capacity)
{
    if (capacity < 1) {
        PyErr_Format(PyExc_ValueError, "capacity must be at least 1, got %zd", capacity);
        return -1;
    }
    return 0;
}

/* ---- LRU ----------------------------------------------------------------------------- */

/* One request in an LRU of `capacity` keys (list 0): 1 hit, 0 miss, -1 error. */
static int
lru_replay(Table *t, Py_ssize_t capacity, PyObject *key, Py_hash_t hash)
{
    Py_ssize_t i = table_find(t, key, hash);
    if (i == -2)
        return -1;
    if (i != NIL) {
        table_move(t, i, 0, 0);
        return 1;
    }
    if (t->lists[0].len >= capacity)
        table_remove(t, t->lists[0].head);
    table_add(t, key, hash, 0, 0);
    return 0;
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

/* One request in the paper's ARC of `capacity` keys with target `*p`: 1 hit, 0 miss, -1 error. */
static int
arc_replay(Table *t, Py_ssize_t capacity, double *p, PyObject *key, Py_hash_t hash)
{
    List *l = t->lists;
    Py_ssize_t i = table_find(t, key, hash);
    if (i == -2)
        return -1;
    if (arc_hit(t, i))
        return 1;
    if (l[T1].len + l[T2].len >= capacity) {
        if (victim_from_t1(l, *p))
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
        *p = target_after_ghost(*p, from_t2, ratio, (double)capacity);
        table_move(t, i, T2, 0);
    }
    else
        table_add(t, key, hash, T1, 0);
    return 0;
}

/* ---- the experts' referee (as _ExpertReferee) ------------------------------------------ */

enum { LRU_EXPERT, ARC_EXPERT };

typedef struct {
    PyObject_HEAD
    Table lru, arc; /* the two shadows, each of `capacity` keys (ARC's ghosts besides) */
    Py_ssize_t capacity;
    double p; /* the ARC shadow's target */
    double decay, long_decay, switch_z2, confirm_z2;
    double scores[2], long_scores[2], apart, long_apart;
    int expert;
} ExpertReferee;

static void
referee_reset(ExpertReferee *self)
{
    self->p = 0.0;
    self->scores[0] = self->scores[1] = self->long_scores[0] = self->long_scores[1] = 0.0;
    self->apart = self->long_apart = 0.0;
    self->expert = LRU_EXPERT;
}

static int
referee_init(ExpertReferee *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"capacity", "decay", "long_decay", "switch_z2", "confirm_z2", NULL};
    Py_ssize_t capacity;
    double decay, long_decay, switch_z2, confirm_z2;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ndddd", names, &capacity, &decay, &long_decay, &switch_z2,
                                     &confirm_z2) ||
        capacity_arg(capacity) < 0)
        return -1; /* a referee whose __init__ ran before is left as it was */
    table_free(&self->lru);
    table_free(&self->arc);
    self->capacity = capacity;
    self->decay = decay;
    self->long_decay = long_decay;
    self->switch_z2 = switch_z2;
    self->confirm_z2 = confirm_z2;
    referee_reset(self);
    if (table_init(&self->lru, capacity + 1) < 0)
        return -1;
    if (table_init(&self->arc, 2 * capacity + 2) < 0) {
        table_free(&self->lru); /* neither, so request() refuses as before __init__ */
        return -1;
    }
    return 0;
}

/* The request in both shadows, the decayed scores, and the switch test of
   AdaptivePolicy._referee: the expert to take over now, or None. */
static PyObject *
referee_request(ExpertReferee *self, PyObject *key)
{
    if (self->lru.nodes == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shadow used before __init__");
        return NULL;
    }
    Py_hash_t hash = PyObject_Hash(key); /* once, for both shadows */
    if (hash == -1)
        return NULL;
    int hit_lru = lru_replay(&self->lru, self->capacity, key, hash);
    int hit_arc = hit_lru < 0 ? -1 : arc_replay(&self->arc, self->capacity, &self->p, key, hash);
    if (hit_arc < 0)
        return NULL;
    double decay = self->decay, long_decay = self->long_decay;
    double *scores = self->scores, *long_scores = self->long_scores;
    scores[LRU_EXPERT] = scores[LRU_EXPERT] * decay + hit_lru;
    scores[ARC_EXPERT] = scores[ARC_EXPERT] * decay + hit_arc;
    long_scores[LRU_EXPERT] = long_scores[LRU_EXPERT] * long_decay + hit_lru;
    long_scores[ARC_EXPERT] = long_scores[ARC_EXPERT] * long_decay + hit_arc;
    int differ = hit_lru != hit_arc;
    self->apart = self->apart * decay + differ;
    self->long_apart = self->long_apart * long_decay + differ;
    int expert = self->expert, other = 1 - expert;
    double ahead = scores[other] - scores[expert];
    if (ahead > 0 && ahead * ahead > self->switch_z2 * self->apart) {
        ahead = long_scores[other] - long_scores[expert];
        if (ahead > 0 && ahead * ahead > self->confirm_z2 * self->long_apart) {
            self->expert = other;
            return PyLong_FromLong(other);
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
referee_state(ExpertReferee *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *lru = list_keys(&self->lru, 0, 0), *arc[4] = {NULL, NULL, NULL, NULL};
    if (lru == NULL)
        return NULL;
    for (int l = 0; l < 4; l++)
        if ((arc[l] = list_keys(&self->arc, l, 0)) == NULL) {
            Py_DECREF(lru);
            for (int k = 0; k < l; k++)
                Py_DECREF(arc[k]);
            return NULL;
        }
    return Py_BuildValue("(i(dd)d(dd)dN(NNNN)d)", self->expert, self->scores[0], self->scores[1], self->apart,
                         self->long_scores[0], self->long_scores[1], self->long_apart, lru, arc[0], arc[1], arc[2],
                         arc[3], self->p);
}

static PyObject *
referee_clear(ExpertReferee *self, PyObject *Py_UNUSED(ignored))
{
    table_clear_list(&self->lru, 0);
    for (int l = 0; l < 4; l++)
        table_clear_list(&self->arc, l);
    referee_reset(self);
    Py_RETURN_NONE;
}

static PyObject *
referee_get_scores(ExpertReferee *self, void *Py_UNUSED(closure))
{
    return Py_BuildValue("[dd]", self->scores[0], self->scores[1]);
}

static PyObject *
referee_get_long_scores(ExpertReferee *self, void *Py_UNUSED(closure))
{
    return Py_BuildValue("[dd]", self->long_scores[0], self->long_scores[1]);
}

static int
referee_set_expert(ExpertReferee *self, PyObject *value, void *Py_UNUSED(closure))
{
    long expert = value == NULL ? -1 : PyLong_AsLong(value);
    if (expert != LRU_EXPERT && expert != ARC_EXPERT) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "expert must be 0 (LRU) or 1 (ARC)");
        return -1;
    }
    self->expert = (int)expert;
    return 0;
}

static PyObject *
referee_get_expert(ExpertReferee *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(self->expert);
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

static void
referee_dealloc(ExpertReferee *self)
{
    table_free(&self->lru);
    table_free(&self->arc);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void
ghosts_dealloc(GhostShadows *self)
{
    ghosts_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef referee_methods[] = {
    {"request", (PyCFunction)referee_request, METH_O,
     "Replay one sampled request in both shadows; the expert to take over now, else None."},
    {"state", (PyCFunction)referee_state, METH_NOARGS,
     "(expert, scores, apart, long_scores, long_apart, LRU's keys, ARC's (T1, T2, B1, B2), p)."},
    {"clear", (PyCFunction)referee_clear, METH_NOARGS, "Forget every key and count; LRU again."},
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

static PyMemberDef referee_members[] = {
    {"capacity", Py_T_PYSSIZET, offsetof(ExpertReferee, capacity), Py_READONLY, "Each shadow's size."},
    {"p", Py_T_DOUBLE, offsetof(ExpertReferee, p), Py_READONLY, "The ARC shadow's target size of T1."},
    {"apart", Py_T_DOUBLE, offsetof(ExpertReferee, apart), Py_READONLY, NULL},
    {"long_apart", Py_T_DOUBLE, offsetof(ExpertReferee, long_apart), Py_READONLY, NULL},
    {NULL},
};
static PyGetSetDef referee_getset[] = {
    {"expert", (getter)referee_get_expert, (setter)referee_set_expert, "The expert followed now.", NULL},
    {"scores", (getter)referee_get_scores, NULL, "Decayed hits of [LRU, ARC] (a copy).", NULL},
    {"long_scores", (getter)referee_get_long_scores, NULL, "The same, with the long memory.", NULL},
    {NULL},
};
static PyMemberDef ghosts_members[] = {
    {"current", Py_T_INT, offsetof(GhostShadows, current), Py_READONLY, "The shadow followed now."},
    {NULL},
};

static PyTypeObject ExpertRefereeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "policies._shadows.ExpertReferee",
    .tp_doc = "LRU and the paper's ARC as shadows of `capacity` keys, and the switch test "
              "between them, as policies.adaptive._ExpertReferee decides.",
    .tp_basicsize = sizeof(ExpertReferee),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)referee_init,
    .tp_dealloc = (destructor)referee_dealloc,
    .tp_methods = referee_methods,
    .tp_members = referee_members,
    .tp_getset = referee_getset,
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
    .m_doc = "The adaptive policies' referees, compiled (policies/adaptive.py has the reference).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__shadows(void)
{
    PyTypeObject *types[] = {&ExpertRefereeType, &GhostShadowsType};
    const char *names[] = {"ExpertReferee", "GhostShadows"};
    PyObject *module = PyModule_Create(&shadows_module);
    if (module == NULL)
        return NULL;
    for (int k = 0; k < 2; k++)
        if (PyType_Ready(types[k]) < 0 || PyModule_AddObjectRef(module, names[k], (PyObject *)types[k]) < 0) {
            Py_DECREF(module);
            return NULL;
        }
    return module;
}
