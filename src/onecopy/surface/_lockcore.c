/* A surface's reader/writer lock, in C: shared-memory slots across processes, counters within one.
 *
 * A bound surface is locked around every engine call: read locks on the inputs, a write lock on the output,
 * whose release moves the generation counter in the surface header on. That work runs right after a call that
 * streamed a frame through the caches, when everything it touches misses them. In Python it cost 25-30 us a
 * 1080p frame; in C with a flock per surface, 10-20 us, most of it the four flock system calls. So across
 * processes the lock is now words in the surface's shared header, and taking or giving it back makes no system
 * call at all when nobody else holds it.
 *
 * Across processes: each LockCore claims one of the header's slots when it is made (a process that opens a
 * surface twice claims two, which exclude each other like two processes). Its slot says what it holds: nothing,
 * a read lock or the write lock. To take a lock it writes its slot, then reads the others' (sequentially
 * consistent atomics, so of two processes racing at least one sees the other and backs off): a reader backs off
 * from a writer, a writer from anyone. A slot is owned by whoever holds an open-file-description lock
 * (F_OFD_SETLK) on its 8 bytes; the kernel drops that lock when the owner closes the surface or dies, so a
 * waiter that finds a slot blocking it can tell a dead owner (it can take that byte lock itself) and clear the
 * slot (`reap`): a process that dies holding a lock does not hold it for ever.
 *
 * Within one process, threads share the slot: the shared state is set by the first reader and cleared by the
 * last, and the write state is taken only when no thread of this process reads. Atomicity among threads comes
 * from the GIL: no function here releases it. A lock that is not granted at once is reported back and lock.py
 * waits for it (polling, reaping), with the GIL released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>

#include "_lockcore.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the surface header is little-endian; onecopy runs on little-endian CPUs (x86_64, aarch64)"
#endif

enum { SLOT_FREE = 0, SLOT_READING = 1, SLOT_WRITING = 2 };

typedef struct {
    PyObject_HEAD
    int fd;
    int closed;
    long readers;          /* read locks held in this process: the slot says SLOT_READING while > 0 */
    unsigned long writer;  /* thread holding the write lock (threading.get_ident()), 0 if none */
    long waiting;          /* threads waiting in lock.py's slow path: a release tells its caller to wake them */
    Py_buffer map;         /* the surface's map, held for the header words until mark_closed() */
    uint64_t *generation;  /* in `map`; NULL once closed */
    uint64_t *slots;       /* the header's slots, in `map` */
    uint64_t *slots_used;  /* how many slots were ever claimed (only those are read) */
    Py_ssize_t slot;       /* this LockCore's slot */
    Py_ssize_t slot_count;
    off_t slots_at;        /* file offset of slot 0: slot i's byte lock covers its 8 bytes */
} LockCore;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

/* An open-file-description lock on slot i's 8 bytes: F_WRLCK to take it (0, or -1 with errno EAGAIN/EACCES
 * when another description holds it), F_UNLCK to give it back. */
static int slot_byte_lock(LockCore *self, Py_ssize_t i, short type) {
    struct flock lock = {.l_type = type, .l_whence = SEEK_SET, .l_start = self->slots_at + 8 * i, .l_len = 8};
    return fcntl(self->fd, F_OFD_SETLK, &lock);
}

static int LockCore_init(LockCore *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"fd", "surface_map", "generation_at", "slots_used_at", "slots_at", "slot_count", NULL};
    int fd;
    PyObject *surface_map;
    Py_ssize_t at, used_at, slots_at, count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOnnnn", keywords, &fd, &surface_map, &at, &used_at, &slots_at,
                                     &count))
        return -1;
    if (self->generation != NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "LockCore is already initialized");
        return -1;
    }
    if (PyObject_GetBuffer(surface_map, &self->map, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t words[] = {at, used_at, slots_at};
    for (int k = 0; k < 3; k++) {
        if (words[k] < 0 || words[k] % 8 != 0 || words[k] + 8 * (k == 2 ? count : 1) > self->map.len || count < 1) {
            PyBuffer_Release(&self->map);
            PyErr_Format(PyExc_ValueError, "header word at byte %zd (%zd slots) does not fit an aligned place in a "
                         "%zd-byte map", words[k], count, self->map.len);
            return -1;
        }
    }
    self->fd = fd;
    self->slots = (uint64_t *)((char *)self->map.buf + slots_at);
    self->slots_used = (uint64_t *)((char *)self->map.buf + used_at);
    self->slot_count = count;
    self->slots_at = slots_at;
    /* Claim the first slot whose byte lock no one holds: free, or left by a process that died (cleared here). */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (slot_byte_lock(self, i, F_WRLCK) == 0) {
            self->slot = i;
            STORE(&self->slots[i], SLOT_FREE);
            uint64_t used = LOAD(self->slots_used);
            while (used < (uint64_t)i + 1 &&
                   !__atomic_compare_exchange_n(self->slots_used, &used, (uint64_t)i + 1, 0, __ATOMIC_SEQ_CST,
                                                __ATOMIC_SEQ_CST)) {
            }
            self->generation = (uint64_t *)((char *)self->map.buf + at);
            return 0;
        }
        if (errno != EAGAIN && errno != EACCES) {
            PyErr_SetFromErrno(PyExc_OSError);
            PyBuffer_Release(&self->map);
            return -1;
        }
    }
    PyBuffer_Release(&self->map);
    PyErr_Format(PyExc_BlockingIOError, "all %zd lock slots of the surface are taken", count);
    return -1;
}

static void LockCore_dealloc(LockCore *self) {
    if (self->generation != NULL) {
        STORE(&self->slots[self->slot], SLOT_FREE); /* whatever this process held of it goes with it */
        PyBuffer_Release(&self->map);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* How many slots to read: those ever claimed (the word is another process's to grow, so it is bounded here). */
static Py_ssize_t slots_in_use(LockCore *self) {
    Py_ssize_t used = (Py_ssize_t)LOAD(self->slots_used);
    return used < self->slot_count ? used : self->slot_count;
}

/* Set this process's slot to `state` if no other slot conflicts: a reader with a writer, a writer with anyone.
 * 1: set; 0: a conflict (the slot is left free). */
static int take_slot(LockCore *self, uint64_t state) {
    STORE(&self->slots[self->slot], state);
    Py_ssize_t used = slots_in_use(self);
    for (Py_ssize_t i = 0; i < used; i++) {
        if (i == self->slot) continue;
        uint64_t other = LOAD(&self->slots[i]);
        if (other == SLOT_WRITING || (state == SLOT_WRITING && other != SLOT_FREE)) {
            STORE(&self->slots[self->slot], SLOT_FREE);
            return 0;
        }
    }
    return 1;
}

/* Take the lock for `thread` if that needs no waiting. 1: taken; 0: not now (closed, held by a thread of this
 * process in a conflicting mode, or by another process). */
static int try_acquire(LockCore *self, int readonly, unsigned long thread) {
    if (self->closed || self->writer != 0) return 0;
    if (readonly) {
        if (self->readers == 0 && !take_slot(self, SLOT_READING)) return 0;
        self->readers++;
        return 1;
    }
    if (self->readers != 0 || !take_slot(self, SLOT_WRITING)) return 0;
    self->writer = thread;
    return 1;
}

/* Give back a lock taken by try_acquire. A writer's release moves the generation counter on first, while the
 * slot still excludes every other process. 0, or -1 with an error set. */
static int release(LockCore *self, int readonly) {
    if (readonly) {
        if (self->readers <= 0) {
            PyErr_SetString(PyExc_RuntimeError, "surface lock: released a read lock this process does not hold");
            return -1;
        }
        if (--self->readers == 0 && self->slots != NULL) STORE(&self->slots[self->slot], SLOT_FREE);
        return 0;
    }
    if (self->writer == 0) {
        PyErr_SetString(PyExc_RuntimeError, "surface lock: released a write lock this process does not hold");
        return -1;
    }
    if (self->generation != NULL) STORE(self->generation, LOAD(self->generation) + 1); /* wraps at 2**64 */
    self->writer = 0;
    if (self->slots != NULL) STORE(&self->slots[self->slot], SLOT_FREE);
    return 0;
}

static PyObject *LockCore_try_acquire(LockCore *self, PyObject *args) {
    int readonly;
    unsigned long thread;
    if (!PyArg_ParseTuple(args, "pk", &readonly, &thread)) return NULL;
    return PyBool_FromLong(try_acquire(self, readonly, thread));
}

/* reap() -> int: clear the slots that hold a lock but whose owner is gone (closed the surface or died: its byte
 * lock is free, so this one can take it); how many were cleared. System calls, so for the slow path only. */
static PyObject *LockCore_reap(LockCore *self, PyObject *Py_UNUSED(ignored)) {
    if (self->slots == NULL) return PyLong_FromLong(0);
    Py_ssize_t used = slots_in_use(self), cleared = 0;
    for (Py_ssize_t i = 0; i < used; i++) {
        if (i == self->slot || LOAD(&self->slots[i]) == SLOT_FREE) continue;
        if (slot_byte_lock(self, i, F_WRLCK) == 0) { /* nobody owns it: the state is stale */
            STORE(&self->slots[i], SLOT_FREE);
            slot_byte_lock(self, i, F_UNLCK);
            cleared++;
        } else if (errno != EAGAIN && errno != EACCES) {
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return PyLong_FromSsize_t(cleared);
}

static PyObject *LockCore_release(LockCore *self, PyObject *arg) {
    int readonly = PyObject_IsTrue(arg);
    if (readonly < 0 || release(self, readonly) < 0) return NULL;
    return PyBool_FromLong(self->waiting > 0);
}

static PyObject *LockCore_mark_closed(LockCore *self, PyObject *Py_UNUSED(ignored)) {
    self->closed = 1;
    if (self->generation != NULL) {
        /* Nothing is held (Surface.close refuses otherwise); the slot's byte lock goes with the descriptor. */
        STORE(&self->slots[self->slot], SLOT_FREE);
        self->generation = NULL;
        self->slots = NULL;
        self->slots_used = NULL;
        PyBuffer_Release(&self->map); /* the surface can unmap once its views are gone */
    }
    Py_RETURN_NONE;
}

static PyMethodDef LockCore_methods[] = {
    {"try_acquire", (PyCFunction)LockCore_try_acquire, METH_VARARGS,
     "try_acquire(readonly, thread) -> bool: take the lock if that needs no waiting."},
    {"release", (PyCFunction)LockCore_release, METH_O,
     "release(readonly) -> bool: give the lock back; true when threads wait for it (wake them)."},
    {"reap", (PyCFunction)LockCore_reap, METH_NOARGS,
     "reap() -> int: clear the lock slots of owners that closed the surface or died; how many."},
    {"mark_closed", (PyCFunction)LockCore_mark_closed, METH_NOARGS,
     "mark_closed(): refuse every later acquire and let go of the map."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef LockCore_members[] = {
    {"closed", T_INT, offsetof(LockCore, closed), READONLY, "true once mark_closed() ran"},
    {"readers", T_LONG, offsetof(LockCore, readers), READONLY, "read locks held in this process"},
    {"writer", T_ULONG, offsetof(LockCore, writer), READONLY, "thread holding the write lock, 0 if none"},
    {"waiting", T_LONG, offsetof(LockCore, waiting), 0, "threads waiting in the slow path (kept by lock.py)"},
    {"slot", T_PYSSIZET, offsetof(LockCore, slot), READONLY, "this lock's slot in the surface header"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LockCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "onecopy.surface._lockcore.LockCore",
    .tp_doc = "The state of one surface's lock, in this process and in the header's slots: LockCore(fd, surface_map, "
              "generation_at, slots_used_at, slots_at, slot_count).",
    .tp_basicsize = sizeof(LockCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LockCore_init,
    .tp_dealloc = (destructor)LockCore_dealloc,
    .tp_methods = LockCore_methods,
    .tp_members = LockCore_members,
};

/* Whether the first `count` of `cores` are LockCores and their `modes` bools (True: a read lock); checked before
 * any lock is taken or given back, so an error leaves every lock as it was. 0, or -1 with an error naming `who`. */
static int check_locks(PyObject *cores, PyObject *modes, Py_ssize_t count, const char *who) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(cores, i), &LockCoreType)) {
            PyErr_Format(PyExc_TypeError, "%s: cores must be LockCore objects", who);
            return -1;
        }
        if (!PyBool_Check(PyTuple_GET_ITEM(modes, i))) {
            PyErr_Format(PyExc_TypeError, "%s: modes must be bools (True: read lock)", who);
            return -1;
        }
    }
    return 0;
}

/* Take each lock in order for `thread`, stopping at the first that would wait: how many were taken, or -1 with an
 * error set (bad arguments; none taken). */
static Py_ssize_t take_locks(PyObject *cores, PyObject *modes, unsigned long thread) {
    Py_ssize_t n = PyTuple_GET_SIZE(cores);
    if (PyTuple_GET_SIZE(modes) != n) {
        PyErr_SetString(PyExc_ValueError, "take_all: one mode per lock");
        return -1;
    }
    if (check_locks(cores, modes, n, "take_all") < 0) return -1;
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        if (!try_acquire((LockCore *)PyTuple_GET_ITEM(cores, i), PyTuple_GET_ITEM(modes, i) == Py_True, thread)) break;
    }
    return i;
}

/* Give back the first `count` locks, last first: 1 when threads wait for any of them, 0 when none do, -1 with an
 * error set. Every lock is given back even when one fails; the first error is the one set. */
static int give_locks(PyObject *cores, PyObject *modes, Py_ssize_t count) {
    if (count < 0 || count > PyTuple_GET_SIZE(cores) || PyTuple_GET_SIZE(modes) != PyTuple_GET_SIZE(cores)) {
        PyErr_SetString(PyExc_ValueError, "give_all: count out of range, or not one mode per lock");
        return -1;
    }
    if (check_locks(cores, modes, count, "give_all") < 0) return -1;
    int waiting = 0;
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    for (Py_ssize_t i = count - 1; i >= 0; i--) {
        LockCore *core = (LockCore *)PyTuple_GET_ITEM(cores, i);
        if (release(core, PyTuple_GET_ITEM(modes, i) == Py_True) < 0) {
            if (type == NULL) PyErr_Fetch(&type, &value, &traceback);
            else PyErr_Clear();
        }
        waiting |= core->waiting > 0;
    }
    if (type != NULL) {
        PyErr_Restore(type, value, traceback);
        return -1;
    }
    return waiting;
}

/* take_all(cores, modes, thread) -> int: take_locks for Python. */
static PyObject *take_all(PyObject *module, PyObject *args) {
    PyObject *cores, *modes;
    unsigned long thread;
    if (!PyArg_ParseTuple(args, "O!O!k", &PyTuple_Type, &cores, &PyTuple_Type, &modes, &thread)) return NULL;
    Py_ssize_t taken = take_locks(cores, modes, thread);
    return taken < 0 ? NULL : PyLong_FromSsize_t(taken);
}

/* give_all(cores, modes, count) -> bool: give_locks for Python. */
static PyObject *give_all(PyObject *module, PyObject *args) {
    PyObject *cores, *modes;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!O!n", &PyTuple_Type, &cores, &PyTuple_Type, &modes, &count)) return NULL;
    int waiting = give_locks(cores, modes, count);
    return waiting < 0 ? NULL : PyBool_FromLong(waiting);
}

/* For other C modules (the delegate's frame run): the same two functions, without Python's argument passing. */
static LockCoreAPI lockcore_api = {take_locks, give_locks};

static PyMethodDef module_methods[] = {
    {"take_all", take_all, METH_VARARGS,
     "take_all(cores, modes, thread) -> int: take the locks in order until one would wait; how many were taken."},
    {"give_all", give_all, METH_VARARGS,
     "give_all(cores, modes, count) -> bool: give back the first `count`, last first; true when threads wait."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lockcore_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "onecopy.surface._lockcore",
    .m_doc = "The fast path of a surface's reader/writer lock (see lock.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__lockcore(void) {
    if (PyType_Ready(&LockCoreType) < 0) return NULL;
    PyObject *module = PyModule_Create(&lockcore_module);
    if (module == NULL) return NULL;
    Py_INCREF(&LockCoreType);
    if (PyModule_AddObject(module, "LockCore", (PyObject *)&LockCoreType) < 0) {
        Py_DECREF(&LockCoreType);
        Py_DECREF(module);
        return NULL;
    }
    PyObject *api = PyCapsule_New(&lockcore_api, LOCKCORE_API_CAPSULE, NULL);
    if (api == NULL || PyModule_AddObject(module, "_C_API", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
