/* Whether a call's arrays are laid out as a kept plan's were, or shaped as a checked call's, in C.
 *
 * `Method.execute` reruns a kept plan when a thread calls again on the same bound surfaces (`repeat_kept` finds
 * and runs it), and skips the checks of a first call when its inputs have the shapes and dtypes of a call that
 * passed them (`same_shapes`; method.py). Deciding that is the first thing to run after the previous call, when
 * the interpreter's and numpy's code and data are out of the caches: reading shape, strides, dtype and flags
 * through numpy's Python getters cost 25-30 us a 1080p frame there. Here it reads the array structs directly: a
 * few cache lines per array.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define NPY_TARGET_VERSION NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <string.h>

/* Whether `given` (n arrays) are laid out as `planned` (n snapshots) from `offset` on: each a numpy array
 * (exactly) at the same address, with the same shape, strides and dtype, and writable when `writable`. */
static int laid_out_as(PyObject *const *given, Py_ssize_t n, PyObject *planned, Py_ssize_t offset, int writable) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = given[i], *p = PyTuple_GET_ITEM(planned, offset + i);
        if (!PyArray_CheckExact(a) || !PyArray_CheckExact(p)) return 0;
        PyArrayObject *x = (PyArrayObject *)a, *y = (PyArrayObject *)p;
        int nd = PyArray_NDIM(x);
        if (PyArray_DATA(x) != PyArray_DATA(y) || nd != PyArray_NDIM(y)) return 0;
        if (nd > 0 && (memcmp(PyArray_DIMS(x), PyArray_DIMS(y), nd * sizeof(npy_intp)) != 0 ||
                       memcmp(PyArray_STRIDES(x), PyArray_STRIDES(y), nd * sizeof(npy_intp)) != 0))
            return 0;
        if (PyArray_DESCR(x) != PyArray_DESCR(y) && !PyArray_EquivTypes(PyArray_DESCR(x), PyArray_DESCR(y)))
            return 0;
        if (writable && !PyArray_ISWRITEABLE(x)) return 0;
    }
    return 1;
}

/* The items of a list or tuple (exactly), borrowed, into `*items` and `*n`: 1; 0 for anything else. (An empty
 * list's item array is NULL, so the pointer cannot say which.) */
static int items_of(PyObject *sequence, PyObject *const **items, Py_ssize_t *n) {
    if (PyList_CheckExact(sequence)) {
        *n = PyList_GET_SIZE(sequence);
        *items = ((PyListObject *)sequence)->ob_item;
        return 1;
    }
    if (PyTuple_CheckExact(sequence)) {
        *n = PyTuple_GET_SIZE(sequence);
        *items = ((PyTupleObject *)sequence)->ob_item;
        return 1;
    }
    return 0;
}

static PyObject *str_repeats;

/* repeat_kept(local, inputs, outputs) -> list | None: `Method.execute`'s first step for a call with output
 * storage. Among the plans this thread keeps (`local.repeats`: (snapshots, run) pairs, newest first), the first
 * whose snapshots `inputs` and `outputs` (lists or tuples) are laid out as (outputs writable) is run (`run()`),
 * and the caller's `outputs` come back as a new list; None when no plan matches (the call goes the checked way).
 * The pairs are plain tuples so that finding a plan reads no attribute but `repeats`. */
static PyObject *repeat_kept(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "repeat_kept(local, inputs, outputs) takes 3 arguments");
        return NULL;
    }
    PyObject *kept = PyObject_GetAttr(args[0], str_repeats);
    if (kept == NULL) return NULL;
    Py_ssize_t n_in = 0, n_out = 0, n_kept = 0;
    PyObject *const *inputs = NULL, *const *outputs = NULL, *const *plans = NULL;
    PyObject *result = Py_None;
    Py_INCREF(result);
    if (!items_of(args[1], &inputs, &n_in) || !items_of(args[2], &outputs, &n_out) || !PyTuple_CheckExact(kept) ||
        !items_of(kept, &plans, &n_kept))
        goto done;
    for (Py_ssize_t k = 0; k < n_kept; k++) {
        PyObject *plan = plans[k];
        if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 2) {
            Py_SETREF(result, NULL);
            PyErr_SetString(PyExc_TypeError, "repeat_kept: local.repeats holds (snapshots, run) pairs");
            goto done;
        }
        PyObject *snapshots = PyTuple_GET_ITEM(plan, 0);
        if (!PyTuple_CheckExact(snapshots) || PyTuple_GET_SIZE(snapshots) != n_in + n_out ||
            !laid_out_as(inputs, n_in, snapshots, 0, 0) || !laid_out_as(outputs, n_out, snapshots, n_in, 1))
            continue;
        PyObject *run = PyTuple_GET_ITEM(plan, 1);
        Py_INCREF(run); /* the run may replace `local.repeats` */
        PyObject *ran = PyObject_CallNoArgs(run);
        Py_DECREF(run);
        if (ran == NULL) {
            Py_SETREF(result, NULL);
            goto done;
        }
        Py_DECREF(ran);
        Py_SETREF(result, PySequence_List(args[2])); /* the caller's own arrays: maybe new views of the storage */
        goto done;
    }
done:
    Py_DECREF(kept);
    return result;
}

/* same_shapes(args, templates, writable=False) -> bool: `args` (a list or tuple) holds exactly as many numpy
 * arrays (exactly) as `templates` (a tuple of arrays), each with the shape and dtype of its template, and writable
 * when `writable` (output storage); addresses and strides are not compared. */
static PyObject *same_shapes(PyObject *module, PyObject *args) {
    PyObject *given, *templates;
    int writable = 0;
    if (!PyArg_ParseTuple(args, "OO!|p", &given, &PyTuple_Type, &templates, &writable)) return NULL;
    Py_ssize_t n = 0;
    PyObject *const *items = NULL;
    if (!items_of(given, &items, &n) || n != PyTuple_GET_SIZE(templates)) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = items[i], *t = PyTuple_GET_ITEM(templates, i);
        if (!PyArray_CheckExact(a) || !PyArray_CheckExact(t)) Py_RETURN_FALSE;
        PyArrayObject *x = (PyArrayObject *)a, *y = (PyArrayObject *)t;
        int nd = PyArray_NDIM(x);
        if (nd != PyArray_NDIM(y)) Py_RETURN_FALSE;
        if (nd > 0 && memcmp(PyArray_DIMS(x), PyArray_DIMS(y), nd * sizeof(npy_intp)) != 0) Py_RETURN_FALSE;
        if (PyArray_DESCR(x) != PyArray_DESCR(y) && !PyArray_EquivTypes(PyArray_DESCR(x), PyArray_DESCR(y)))
            Py_RETURN_FALSE;
        if (writable && !PyArray_ISWRITEABLE(x)) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef module_methods[] = {
    {"repeat_kept", (PyCFunction)(void (*)(void))repeat_kept, METH_FASTCALL,
     "repeat_kept(local, inputs, outputs) -> list | None: run the kept plan this call repeats, if any."},
    {"same_shapes", same_shapes, METH_VARARGS,
     "same_shapes(args, templates, writable=False) -> bool: `args` (list or tuple) are numpy arrays with the "
     "shapes and dtypes of `templates`, one each (and writable when `writable`)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef layout_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "onecopy.runtime._layout",
    .m_doc = "Whether a call's arrays are laid out as a kept plan's were, or shaped as a checked call's (see method.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__layout(void) {
    import_array();
    str_repeats = PyUnicode_InternFromString("repeats");
    if (str_repeats == NULL) return NULL;
    return PyModule_Create(&layout_module);
}
