/* Whether a call's arrays are laid out as a kept plan's were, in C.
 *
 * `Method.execute` reruns a kept plan when a thread calls again on the same bound surfaces, and skips the checks
 * of a first call when its inputs have the shapes and dtypes of a call that passed them (method.py). Deciding
 * that is the first thing to run after the previous call, when the interpreter's and numpy's code and data are
 * out of the caches: reading shape, strides, dtype and flags through numpy's Python getters cost 25-30 us a 1080p
 * frame there. Here it reads the array structs directly: a few cache lines per array.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define NPY_TARGET_VERSION NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <string.h>

/* same_layout(args, planned, writable_from) -> bool: each of `args` is a numpy array (exactly) at the same
 * address, with the same shape, strides and dtype as the array at the same place in `planned` (snapshots the
 * caller cannot reshape: views made when the plan was), and those from `writable_from` on are writable. */
static PyObject *same_layout(PyObject *module, PyObject *args) {
    PyObject *given, *planned;
    Py_ssize_t writable_from;
    if (!PyArg_ParseTuple(args, "O!O!n", &PyTuple_Type, &given, &PyTuple_Type, &planned, &writable_from)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(planned);
    if (PyTuple_GET_SIZE(given) != n) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(given, i), *p = PyTuple_GET_ITEM(planned, i);
        if (!PyArray_CheckExact(a) || !PyArray_CheckExact(p)) Py_RETURN_FALSE;
        PyArrayObject *x = (PyArrayObject *)a, *y = (PyArrayObject *)p;
        int nd = PyArray_NDIM(x);
        if (PyArray_DATA(x) != PyArray_DATA(y) || nd != PyArray_NDIM(y)) Py_RETURN_FALSE;
        if (nd > 0 && (memcmp(PyArray_DIMS(x), PyArray_DIMS(y), nd * sizeof(npy_intp)) != 0 ||
                       memcmp(PyArray_STRIDES(x), PyArray_STRIDES(y), nd * sizeof(npy_intp)) != 0))
            Py_RETURN_FALSE;
        if (PyArray_DESCR(x) != PyArray_DESCR(y) && !PyArray_EquivTypes(PyArray_DESCR(x), PyArray_DESCR(y)))
            Py_RETURN_FALSE;
        if (i >= writable_from && !PyArray_ISWRITEABLE(x)) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* same_shapes(args, templates) -> bool: `args` (a list or tuple) holds exactly as many numpy arrays (exactly) as
 * `templates` (a tuple of arrays), each with the shape and dtype of its template; addresses and strides are not
 * compared. */
static PyObject *same_shapes(PyObject *module, PyObject *args) {
    PyObject *given, *templates;
    if (!PyArg_ParseTuple(args, "OO!", &given, &PyTuple_Type, &templates)) return NULL;
    PyObject **items;
    Py_ssize_t n;
    if (PyList_CheckExact(given)) {
        items = ((PyListObject *)given)->ob_item;
        n = PyList_GET_SIZE(given);
    } else if (PyTuple_CheckExact(given)) {
        items = ((PyTupleObject *)given)->ob_item;
        n = PyTuple_GET_SIZE(given);
    } else {
        Py_RETURN_FALSE;
    }
    if (n != PyTuple_GET_SIZE(templates)) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = items[i], *t = PyTuple_GET_ITEM(templates, i);
        if (!PyArray_CheckExact(a) || !PyArray_CheckExact(t)) Py_RETURN_FALSE;
        PyArrayObject *x = (PyArrayObject *)a, *y = (PyArrayObject *)t;
        int nd = PyArray_NDIM(x);
        if (nd != PyArray_NDIM(y)) Py_RETURN_FALSE;
        if (nd > 0 && memcmp(PyArray_DIMS(x), PyArray_DIMS(y), nd * sizeof(npy_intp)) != 0) Py_RETURN_FALSE;
        if (PyArray_DESCR(x) != PyArray_DESCR(y) && !PyArray_EquivTypes(PyArray_DESCR(x), PyArray_DESCR(y)))
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef module_methods[] = {
    {"same_layout", same_layout, METH_VARARGS,
     "same_layout(args, planned, writable_from) -> bool: same address, shape, strides and dtype as `planned`, "
     "each a numpy array, those from `writable_from` on writable."},
    {"same_shapes", same_shapes, METH_VARARGS,
     "same_shapes(args, templates) -> bool: `args` (list or tuple) are numpy arrays with the shapes and dtypes of "
     "`templates`, one each."},
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
    return PyModule_Create(&layout_module);
}
