/* A C extension that leaks, built without frame pointers (-O2 -fomit-frame-pointer) like most
 * wheels: the recorded stack must still reach from the allocating C function up through its
 * C caller to the Python functions that called it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

static void *kept[1 << 16];
static size_t nkept;

__attribute__((noinline)) static void *ext_alloc_record(size_t n)
{
    char *p = malloc(n);
    if (p)
        memset(p, 0x5a, n);   /* touch it: resident, and the call is not optimised away */
    return p;
}

__attribute__((noinline)) static void ext_parse_record(size_t n)
{
    void *p = ext_alloc_record(n);
    if (p && nkept < sizeof(kept) / sizeof(kept[0]))
        kept[nkept++] = p;
    __asm__ volatile("" ::: "memory");
}

static void leak_n(size_t size, size_t count)
{
    for (size_t i = 0; i < count; i++)
        ext_parse_record(size);
}

/* leak(size, count, release_gil) */
static PyObject *leak(PyObject *self, PyObject *args)
{
    Py_ssize_t size, count;
    int release = 0;
    if (!PyArg_ParseTuple(args, "nn|p", &size, &count, &release))
        return NULL;
    if (release) {
        Py_BEGIN_ALLOW_THREADS
        leak_n((size_t)size, (size_t)count);
        Py_END_ALLOW_THREADS
    } else {
        leak_n((size_t)size, (size_t)count);
    }
    return PyLong_FromSize_t(nkept);
}

static PyMethodDef methods[] = {
    {"leak", leak, METH_VARARGS, "Allocate count blocks of size bytes and keep them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "leakext", NULL, -1, methods};

PyMODINIT_FUNC PyInit_leakext(void)
{
    return PyModule_Create(&module);
}
