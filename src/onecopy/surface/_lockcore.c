/* The fast path of a surface's reader/writer lock, in C.
 *
 * A bound surface is locked around every engine call: read locks on the inputs, a write lock on the output,
 * whose release moves the generation counter in the surface header on. That work runs right after a call that
 * streamed a frame through the caches, when every Python object it touches misses them: in Python it cost
 * 25-30 us a 1080p frame (5% of the call), the flock system calls about 10 us of it (benchmarks/README.md,
 * frames). Here it is one C call before the engine call and one after, over a few words of state per surface.
 *
 * Atomicity comes from the GIL: no function here releases it, so each one runs whole with respect to every
 * other Python thread. The flocks are non-blocking (LOCK_NB), so holding the GIL through them never waits on
 * another process; a lock that is not granted at once is reported back and lock.py waits for it (polling), with
 * the GIL released.
 *
 * Across processes the lock is a flock on the surface's descriptor. Threads of one process share that descriptor's
 * open file description, where a second flock would convert or drop the first: so the shared flock is taken by the
 * first reader of this process and dropped by the last, and the exclusive one is taken only when no thread of
 * this process reads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/file.h>

#include "_lockcore.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the surface header is little-endian; onecopy runs on little-endian CPUs (x86_64, aarch64)"
#endif

typedef struct {
    PyObject_HEAD
    int fd;
    int closed;
    long readers;          /* read locks held in this process: the shared flock is held while > 0 */
    unsigned long writer;  /* thread holding the write lock (threading.get_ident()), 0 if none */
    long waiting;          /* threads waiting in lock.py's slow path: a release tells its caller to wake them */
    Py_buffer map;         /* the surface's map, held for the generation counter until mark_closed() */
    uint64_t *generation;  /* in `map`; NULL once closed */
} LockCore;

static int LockCore_init(LockCore *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"fd", "surface_map", "generation_at", NULL};
    int fd;
    PyObject *surface_map;
    Py_ssize_t at;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOn", keywords, &fd, &surface_map, &at)) return -1;
    if (self->generation != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "LockCore is already initialized");
        return -1;
    }
    if (PyObject_GetBuffer(surface_map, &self->map, PyBUF_WRITABLE) < 0) return -1;
    if (at < 0 || at % 8 != 0 || at + 8 > self->map.len) {
        PyBuffer_Release(&self->map);
        PyErr_Format(PyExc_ValueError, "generation counter at byte %zd does not fit an aligned 8-byte slot of a %zd-byte map",
                     at, self->map.len);
        return -1;
    }
    self->fd = fd;
    self->generation = (uint64_t *)((char *)self->map.buf + at);
    return 0;
}

static void LockCore_dealloc(LockCore *self) {
    if (self->generation != NULL) PyBuffer_Release(&self->map);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Take the lock for `thread` if that needs no waiting. 1: taken; 0: not now (closed, held by a thread of this
 * process in a conflicting mode, or by another process); -1: error set. */
static int try_acquire(LockCore *self, int readonly, unsigned long thread) {
    if (self->closed || self->writer != 0) return 0;
    if (readonly) {
        if (self->readers == 0 && flock(self->fd, LOCK_SH | LOCK_NB) != 0) {
            if (errno == EWOULDBLOCK) return 0;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->readers++;
        return 1;
    }
    if (self->readers != 0) return 0;
    if (flock(self->fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno == EWOULDBLOCK) return 0;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->writer = thread;
    return 1;
}

/* Give back a lock taken by try_acquire. A writer's release moves the generation counter on first, under the
 * exclusive flock (no other process bumps it at once). 0 or -1 with an error set. */
static int release(LockCore *self, int readonly) {
    if (readonly) {
        if (self->readers <= 0) {
            PyErr_SetString(PyExc_RuntimeError, "surface lock: released a read lock this process does not hold");
            return -1;
        }
        if (--self->readers == 0 && flock(self->fd, LOCK_UN) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        return 0;
    }
    if (self->writer == 0) {
        PyErr_SetString(PyExc_RuntimeError, "surface lock: released a write lock this process does not hold");
        return -1;
    }
    if (self->generation != NULL) (*self->generation)++; /* wraps at 2**64, as the header says */
    self->writer = 0;
    if (flock(self->fd, LOCK_UN) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static PyObject *LockCore_try_acquire(LockCore *self, PyObject *args) {
    int readonly;
    unsigned long thread;
    if (!PyArg_ParseTuple(args, "pk", &readonly, &thread)) return NULL;
    int taken = try_acquire(self, readonly, thread);
    if (taken < 0) return NULL;
    return PyBool_FromLong(taken);
}

static PyObject *LockCore_release(LockCore *self, PyObject *arg) {
    int readonly = PyObject_IsTrue(arg);
    if (readonly < 0 || release(self, readonly) < 0) return NULL;
    return PyBool_FromLong(self->waiting > 0);
}

static PyObject *LockCore_mark_closed(LockCore *self, PyObject *Py_UNUSED(ignored)) {
    self->closed = 1;
    if (self->generation != NULL) {
        self->generation = NULL;
        PyBuffer_Release(&self->map); /* the surface can unmap once its views are gone */
    }
    Py_RETURN_NONE;
}

static PyMethodDef LockCore_methods[] = {
    {"try_acquire", (PyCFunction)LockCore_try_acquire, METH_VARARGS,
     "try_acquire(readonly, thread) -> bool: take the lock if that needs no waiting."},
    {"release", (PyCFunction)LockCore_release, METH_O,
     "release(readonly) -> bool: give the lock back; true when threads wait for it (wake them)."},
    {"mark_closed", (PyCFunction)LockCore_mark_closed, METH_NOARGS,
     "mark_closed(): refuse every later acquire and let go of the map."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef LockCore_members[] = {
    {"closed", T_INT, offsetof(LockCore, closed), READONLY, "true once mark_closed() ran"},
    {"readers", T_LONG, offsetof(LockCore, readers), READONLY, "read locks held in this process"},
    {"writer", T_ULONG, offsetof(LockCore, writer), READONLY, "thread holding the write lock, 0 if none"},
    {"waiting", T_LONG, offsetof(LockCore, waiting), 0, "threads waiting in the slow path (kept by lock.py)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LockCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "onecopy.surface._lockcore.LockCore",
    .tp_doc = "The in-process state and flock of one surface's lock: LockCore(fd, surface_map, generation_at).",
    .tp_basicsize = sizeof(LockCore),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LockCore_init,
    .tp_dealloc = (destructor)LockCore_dealloc,
    .tp_methods = LockCore_methods,
    .tp_members = LockCore_members,
};

/* Take each lock in order for `thread`, stopping at the first that would wait: how many were taken, or -1 with an
 * error set and none held (those taken before the failing one are given back). */
static Py_ssize_t take_locks(PyObject *cores, PyObject *modes, unsigned long thread) {
    Py_ssize_t n = PyTuple_GET_SIZE(cores);
    if (PyTuple_GET_SIZE(modes) != n) {
        PyErr_SetString(PyExc_ValueError, "take_all: one mode per lock");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* checked before any lock is taken */
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(cores, i), &LockCoreType)) {
            PyErr_SetString(PyExc_TypeError, "take_all: cores must be LockCore objects");
            return -1;
        }
        if (!PyBool_Check(PyTuple_GET_ITEM(modes, i))) {
            PyErr_SetString(PyExc_TypeError, "take_all: modes must be bools (True: read lock)");
            return -1;
        }
    }
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        int taken = try_acquire((LockCore *)PyTuple_GET_ITEM(cores, i), PyTuple_GET_ITEM(modes, i) == Py_True, thread);
        if (taken < 0) { /* a flock failed (not "would block"): give back the ones before, keep its error */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            for (Py_ssize_t j = i - 1; j >= 0; j--) {
                if (release((LockCore *)PyTuple_GET_ITEM(cores, j), PyTuple_GET_ITEM(modes, j) == Py_True) < 0)
                    PyErr_Clear();
            }
            PyErr_Restore(type, value, traceback);
            return -1;
        }
        if (!taken) break;
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
    /* Checked before any lock is given back, so an error here leaves every lock as it was. */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (!PyObject_TypeCheck(PyTuple_GET_ITEM(cores, i), &LockCoreType)) {
            PyErr_SetString(PyExc_TypeError, "give_all: cores must be LockCore objects");
            return -1;
        }
        if (!PyBool_Check(PyTuple_GET_ITEM(modes, i))) {
            PyErr_SetString(PyExc_TypeError, "give_all: modes must be bools (True: read lock)");
            return -1;
        }
    }
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
