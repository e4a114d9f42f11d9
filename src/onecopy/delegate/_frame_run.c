/* The frame step in C: an accelerator of exactly its definition, `FrameStep` in frame_step.py, built from the same
 * fields and run by default (ONECOPY_PYTHON_FRAME_STEP=1 runs the definition; tests/runtime/test_frame_step.py and
 * tests/delegate/test_frame_run.py hold the two to the same results, stats and errors).
 *
 * Why C: a frame step runs after a call that streamed a frame through the caches, where each Python frame and
 * attribute lookup misses them. Measured after a cache flush, the step in one Python closure added ~43 us to the
 * raw engine call on a small frame model, this ~25, of which ~20 were the locks, most of it their flock system
 * calls; with the locks in shared memory (_lockcore.c) this is ~17-19 (benchmarks/frame_overhead.py).
 *
 * A FrameRun holds nothing but what the Python objects would: the engine's argument list, the lock cores and
 * modes, the context pool, the method's closed flag, stats and thread-local record. Every rare or slow case
 * (the program closed, a lock that needs waiting, the engine failing, debug logging) calls back into Python.
 * The GIL is held throughout except inside the engine call (IREE releases it there), so the context pool's
 * pop and append and the locks' fast path are atomic with respect to other threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

#include "../surface/_lockcore.h"

static const LockCoreAPI *locks_api;
static PyObject *str_invoke, *str_stats;

typedef struct {
    PyObject_HEAD
    /* The method */
    PyObject *is_closed;     /* () -> bool: the program was closed */
    PyObject *on_closed;     /* () -> raises the error for a call on a closed program */
    PyObject *debug_enabled; /* (level) -> bool: logging.Logger.isEnabledFor */
    PyObject *debug_level;
    PyObject *record;        /* (stats, True): log the call's stats (only when debug_enabled) */
    PyObject *local;         /* the method's threading.local: .stats = stats after each run */
    PyObject *stats;         /* the run's CopyStats: the same every run (nothing is copied) */
    PyObject *outputs;       /* tuple: the output arrays, returned as a new list */
    /* The engine call */
    PyObject *pool;          /* list of free VM contexts (LoadedModel._pool) */
    PyObject *new_context;   /* () -> a VM context, when the pool is empty */
    PyObject *vm_function;
    PyObject *arguments;     /* VmVariantList of the surfaces' buffer views */
    PyObject *result_list;   /* VmVariantList, the type */
    PyObject *result_count;  /* int */
    PyObject *engine_error;  /* (RuntimeError | ValueError) -> the exception to raise from it */
    /* The surfaces' locks */
    PyObject *cores;         /* tuple of LockCore, in name order */
    PyObject *modes;         /* tuple of bool, True: read lock */
    PyObject *wait_locks;    /* (taken) -> int: takes the rest, waiting as needed; raises when a surface is closed */
    PyObject *wake;          /* (taken) -> None: wake the threads waiting for the first `taken` locks */
} FrameRun;

#define FRAME_RUN_FIELDS(X) \
    X(is_closed) X(on_closed) X(debug_enabled) X(debug_level) X(record) X(local) X(stats) X(outputs) X(pool) \
    X(new_context) X(vm_function) X(arguments) X(result_list) X(result_count) X(engine_error) X(cores) X(modes) \
    X(wait_locks) X(wake)

static int FrameRun_traverse(FrameRun *self, visitproc visit, void *arg) {
#define VISIT(name) Py_VISIT(self->name);
    FRAME_RUN_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int FrameRun_clear(FrameRun *self) {
#define CLEAR(name) Py_CLEAR(self->name);
    FRAME_RUN_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void FrameRun_dealloc(FrameRun *self) {
    PyObject_GC_UnTrack(self);
    FrameRun_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int FrameRun_init(FrameRun *self, PyObject *args, PyObject *kwargs) {
#define NAME(name) #name,
    static char *keywords[] = {FRAME_RUN_FIELDS(NAME) NULL};
#undef NAME
#define DECLARE(name) PyObject *name;
    FRAME_RUN_FIELDS(DECLARE)
#undef DECLARE
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOOOOOO!O!OOOOOOO!O!OO", keywords, &is_closed, &on_closed,
                                     &debug_enabled, &debug_level, &record, &local, &stats, &PyTuple_Type, &outputs,
                                     &PyList_Type, &pool, &new_context, &vm_function, &arguments, &result_list,
                                     &result_count, &engine_error, &PyTuple_Type, &cores, &PyTuple_Type, &modes,
                                     &wait_locks, &wake))
        return -1;
    if (PyTuple_GET_SIZE(cores) != PyTuple_GET_SIZE(modes)) {
        PyErr_SetString(PyExc_ValueError, "FrameRun: one mode per lock core");
        return -1;
    }
#define SET(name) Py_INCREF(name); Py_XSETREF(self->name, name);
    FRAME_RUN_FIELDS(SET)
#undef SET
    return 0;
}

/* Call `fn(count)`; a new reference or NULL. */
static PyObject *call_with_count(PyObject *fn, Py_ssize_t count) {
    PyObject *n = PyLong_FromSsize_t(count);
    if (n == NULL) return NULL;
    PyObject *result = PyObject_CallOneArg(fn, n);
    Py_DECREF(n);
    return result;
}

/* After a cleanup step raised, as in a Python `finally:`: its error becomes the pending one, with the one pending
 * before (if any) as its context. */
static void supersede(PyObject **type, PyObject **value, PyObject **traceback) {
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (*type != NULL) {
        PyErr_NormalizeException(type, value, traceback);
        if (*traceback != NULL) PyException_SetTraceback(*value, *traceback);
        PyException_SetContext(v, *value); /* steals *value */
        Py_DECREF(*type);
        Py_XDECREF(*traceback);
    }
    *type = t, *value = v, *traceback = tb;
}

/* `raise engine_error(e) from e` for the pending RuntimeError (a failed run) or ValueError (a refused call) `e` of
 * the engine call; any other exception stays. */
static void raise_engine_error(FrameRun *self) {
    if (!PyErr_ExceptionMatches(PyExc_RuntimeError) && !PyErr_ExceptionMatches(PyExc_ValueError)) return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL) PyException_SetTraceback(value, traceback);
    Py_DECREF(type);
    Py_XDECREF(traceback);
    PyObject *error = PyObject_CallOneArg(self->engine_error, value);
    if (error == NULL) { /* making the error failed: that failure, in the context of the engine's */
        PyObject *t, *v, *tb;
        PyErr_Fetch(&t, &v, &tb);
        PyErr_NormalizeException(&t, &v, &tb);
        PyException_SetContext(v, value); /* steals value */
        PyErr_Restore(t, v, tb);
        return;
    }
    Py_INCREF(value);
    PyException_SetCause(error, value);   /* steals a reference */
    PyException_SetContext(error, value); /* steals the other */
    PyErr_SetObject((PyObject *)Py_TYPE(error), error);
    Py_DECREF(error);
}

static PyObject *FrameRun_call(FrameRun *self, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "a planned run takes no arguments");
        return NULL;
    }
    if (self->cores == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "FrameRun was not initialized");
        return NULL;
    }
    PyObject *flag = PyObject_CallNoArgs(self->is_closed);
    if (flag == NULL) return NULL;
    int closed = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (closed != 0) {
        if (closed > 0) {
            PyObject *r = PyObject_CallNoArgs(self->on_closed); /* raises */
            if (r != NULL) {
                Py_DECREF(r);
                PyErr_SetString(PyExc_RuntimeError, "the program is closed");
            }
        }
        return NULL;
    }
    /* Decided before the engine runs, like everything else here. */
    flag = PyObject_CallOneArg(self->debug_enabled, self->debug_level);
    if (flag == NULL) return NULL;
    int debug = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (debug < 0) return NULL;
    PyObject *results = PyObject_CallOneArg(self->result_list, self->result_count);
    if (results == NULL) return NULL;

    /* LoadedModel.checkout: the last free context, or a new one. */
    PyObject *context;
    Py_ssize_t free_contexts = PyList_GET_SIZE(self->pool);
    if (free_contexts > 0) {
        context = PyList_GET_ITEM(self->pool, free_contexts - 1);
        Py_INCREF(context);
        if (PyList_SetSlice(self->pool, free_contexts - 1, free_contexts, NULL) < 0) {
            Py_DECREF(context);
            Py_DECREF(results);
            return NULL;
        }
    } else {
        context = PyObject_CallNoArgs(self->new_context);
        if (context == NULL) {
            Py_DECREF(results);
            return NULL;
        }
    }

    /* Held for the call: readers share, the surface written in place is exclusive. */
    Py_ssize_t lock_count = PyTuple_GET_SIZE(self->cores), taken = 0;
    PyObject *invoked = NULL;
    if (lock_count > 0) {
        taken = locks_api->take_all(self->cores, self->modes, PyThread_get_thread_ident());
        if (taken < 0) { /* none held */
            taken = 0;
            goto give_back;
        }
        if (taken < lock_count) { /* one would wait, or is closed: Python waits, or says which */
            PyObject *all = call_with_count(self->wait_locks, taken);
            if (all == NULL) goto give_back; /* it gave back what it took; the first `taken` are still ours */
            Py_ssize_t now = PyLong_AsSsize_t(all);
            Py_DECREF(all);
            if (now == -1 && PyErr_Occurred()) goto give_back;
            taken = now;
        }
    }
    {
        PyObject *call[] = {context, self->vm_function, self->arguments, results};
        invoked = PyObject_VectorcallMethod(str_invoke, call, 4 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (invoked == NULL) raise_engine_error(self);
    }

give_back:;
    /* A `finally:`: the context and the locks go back whatever happened; an error is raised after. */
    PyObject *type = NULL, *value = NULL, *traceback = NULL;
    if (invoked == NULL) PyErr_Fetch(&type, &value, &traceback);
    Py_XDECREF(invoked);
    Py_DECREF(results);
    if (PyList_Append(self->pool, context) < 0) supersede(&type, &value, &traceback);
    Py_DECREF(context);
    if (taken > 0) {
        int waiting = locks_api->give_all(self->cores, self->modes, taken);
        if (waiting < 0) supersede(&type, &value, &traceback);
        if (waiting > 0) {
            PyObject *r = call_with_count(self->wake, taken);
            if (r == NULL) supersede(&type, &value, &traceback);
            Py_XDECREF(r);
        }
    }
    if (type != NULL) {
        PyErr_Restore(type, value, traceback);
        return NULL;
    }

    if (PyObject_SetAttr(self->local, str_stats, self->stats) < 0) return NULL;
    if (debug) {
        PyObject *r = PyObject_CallFunctionObjArgs(self->record, self->stats, Py_True, NULL);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    return PySequence_List(self->outputs);
}

static PyTypeObject FrameRunType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "onecopy.delegate._frame_run.FrameRun",
    .tp_doc = "A frame step (frame_step.FrameStep) in C: run it by calling it with no arguments.",
    .tp_basicsize = sizeof(FrameRun),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FrameRun_init,
    .tp_dealloc = (destructor)FrameRun_dealloc,
    .tp_traverse = (traverseproc)FrameRun_traverse,
    .tp_clear = (inquiry)FrameRun_clear,
    .tp_call = (ternaryfunc)FrameRun_call,
};

static struct PyModuleDef frame_run_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "onecopy.delegate._frame_run",
    .m_doc = "The frame step in C, an accelerator of frame_step.FrameStep.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__frame_run(void) {
    locks_api = (const LockCoreAPI *)PyCapsule_Import(LOCKCORE_API_CAPSULE, 0);
    if (locks_api == NULL) return NULL;
    str_invoke = PyUnicode_InternFromString("invoke");
    str_stats = PyUnicode_InternFromString("stats");
    if (str_invoke == NULL || str_stats == NULL) return NULL;
    if (PyType_Ready(&FrameRunType) < 0) return NULL;
    PyObject *module = PyModule_Create(&frame_run_module);
    if (module == NULL) return NULL;
    Py_INCREF(&FrameRunType);
    if (PyModule_AddObject(module, "FrameRun", (PyObject *)&FrameRunType) < 0) {
        Py_DECREF(&FrameRunType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
