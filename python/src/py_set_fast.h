/* py_set_fast.h - the per-tensor loops of a tensor set, in C: what the
 * Python side would otherwise do once per member with an interpreter frame
 * around each torch call (a state_dict is hundreds of members). */
#ifndef TSHARE_PY_SET_FAST_H
#define TSHARE_PY_SET_FAST_H

#include <Python.h>

/* _set_items(tensors, complex_dtypes) -> [(name, data_ptr, dtype, shape,
 * strides, lazy)]: what a set's send reads of each member. */
PyObject *py_set_items(PyObject *module, PyObject *args);

/* _set_members(kind_views, views) -> {name: kind_views[kind].as_strided(shape,
 * strides, offset)} for views' (name, kind, shape, strides, offset). */
PyObject *py_set_members(PyObject *module, PyObject *args);

/* _bound(capsule, from_dlpack, raw_storage) -> tensor: torch's tensor over
 * capsule, its storage bound to the capsule's memory (what makes its
 * tensors known as received ones, and sent on as such). */
PyObject *py_bound(PyObject *module, PyObject *args);

/* _bound_made(capsule, maker, dtype) -> tensor: the same, made by
 * maker(capsule, dtype) -> (tensor, storage key) (tshare._torch_native's
 * tensor_of). */
PyObject *py_bound_made(PyObject *module, PyObject *args);

/* _bound_all(capsules, from_dlpack, raw_storage) -> [tensor]: a torch tensor
 * over each capsule, its storage bound to the capsule's memory. */
PyObject *py_bound_all(PyObject *module, PyObject *args);

/* _bind_keys(capsules, keys) -> None: each consumed capsule's memory bound to
 * the storage key (StorageImpl address) its tensor got elsewhere
 * (tshare._torch_native), as _bound binds it. */
PyObject *py_bind_keys(PyObject *module, PyObject *args);

int py_set_fast_init(void);

#endif
