/* What _lockcore.c offers other C modules, through the capsule `onecopy.surface._lockcore._C_API`:
 *
 *     const LockCoreAPI *locks = PyCapsule_Import(LOCKCORE_API_CAPSULE, 0);
 *
 * Both functions take tuples of LockCore objects and of bools (True: a read lock), as take_all/give_all do in
 * Python, and must be called with the GIL held (it is what makes them atomic). */
#ifndef ONECOPY_LOCKCORE_H
#define ONECOPY_LOCKCORE_H

#include <Python.h>

#define LOCKCORE_API_CAPSULE "onecopy.surface._lockcore._C_API"

typedef struct {
    /* Take the locks in order until one would wait: how many were taken; -1 with an error set. */
    Py_ssize_t (*take_all)(PyObject *cores, PyObject *modes, unsigned long thread);
    /* Give back the first `count`, last first: 1 when threads wait for one of them (wake them), 0 when none
     * do, -1 with an error set (every lock is given back all the same). */
    int (*give_all)(PyObject *cores, PyObject *modes, Py_ssize_t count);
} LockCoreAPI;

#endif
