/* py_memory.h - tshare memory under torch tensors.
 *
 * A received view or a host buffer (empty_shared) becomes a torch tensor
 * through a DLPack capsule whose deleter gives the memory back: the view is
 * released, the buffer's reference dropped. The deleter runs exactly once,
 * on whatever thread frees the tensor's storage, and needs no GIL.
 *
 * Once torch has built the tensor, its storage is bound to the memory by the
 * storage's identity (not its address: two shares of one tensor map to the
 * same address), so a later send of that tensor, or of any view of it, finds
 * how its memory travels: a received view is shared on, a host buffer is
 * shared as a memfd. The binding goes with the storage. */
#ifndef TSHARE_PY_MEMORY_H
#define TSHARE_PY_MEMORY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <tshare/tshare.h>

/* PY_MEM_PINNED: a received set's memory released with its tensors kept
 * (Received.release): the producer's to change, sent on by no one. */
typedef enum py_mem_kind { PY_MEM_NONE = 0, PY_MEM_VIEW = 1, PY_MEM_HOST_BUFFER = 2, PY_MEM_PINNED = 3 } py_mem_kind;

/* How capsules are made for the installed torch: versioned (DLPack 1.0) or
 * classic; whether bool travels as uint8 (torch builds without kDLBool). */
void py_memory_configure(int versioned, int bool_as_uint8);
int py_memory_versioned(void);

/* A capsule over a received view; the capsule (then the tensor) owns the view. */
PyObject *py_memory_view_capsule(tshare_view *view);

/* A capsule over nbytes of the view's memory from its first element, as a
 * 1-D uint8 tensor (what a set's members of one memory are views of); the
 * capsule owns the view. */
PyObject *py_memory_view_bytes_capsule(tshare_view *view, uint64_t nbytes);

/* A capsule laid out as d over data, which holds no memory until
 * py_memory_attach_view gives it a view of the memory at data (the next
 * set's tensors, made while recv waits: py_set_ahead.h). Dropped before,
 * it gives nothing back. */
PyObject *py_memory_pending_capsule(void *data, const tshare_tensor_desc *d, int device_type, int device_id);

/* The view a pending capsule's memory is, once torch consumed the capsule;
 * the storage owns it from then on. 0, or -1 with a Python error (the
 * caller keeps the view). */
int py_memory_attach_view(PyObject *capsule, tshare_view *view);

/* Tensors kept across versions (tshare.Received.release): each capsule's
 * view (of a set member's memory) released, the set going back to the
 * producer once all are, while the memory stays mapped under the tensors
 * (tshare_set_view_release_pinned) until py_memory_attach_view gives it
 * the next version's view, or the tensors go. All or none: the number
 * released (capsules released before count for nothing), or -1 with a
 * Python error (a capsule of no set member, one whose tensor was sent on
 * and is still out). GIL held. */
int py_memory_release_pinned(PyObject *const *capsules, Py_ssize_t n);

/* A send on of a received tensor (storage_key) under way: while counted, a
 * release of its memory with py_memory_release_pinned is refused.
 * py_memory_lookup_forward is py_memory_lookup that, finding a received view
 * (PY_MEM_VIEW), counts a forward in the same look and returns its token
 * (else NULL) that more (one more hold: a share out) and end (one less)
 * take; end from any thread. The caller holds a tensor on the storage from
 * the lookup to its last end. */
py_mem_kind py_memory_lookup_forward(uintptr_t storage_key, void **memory, void **token);
void py_memory_forward_more(void *token);
void py_memory_forward_end(void *token);

/* A capsule over a new zero-filled host buffer of nbytes as a 1-D uint8
 * tensor; NULL with a Python error set on failure. */
PyObject *py_memory_host_capsule(size_t nbytes);

/* Bind the memory under a consumed capsule to a storage identity; a
 * pending capsule's memory is found by it once its view is attached. */
int py_memory_bind(PyObject *capsule, uintptr_t storage_key);

/* The memory bound to a storage identity, if any. The pointer stays valid
 * while the caller holds a tensor on that storage. */
py_mem_kind py_memory_lookup(uintptr_t storage_key, void **memory);

/* The live host buffer (empty_shared, share_memory_, share_model_) whose
 * memory holds addr, or NULL. The buffer stays valid while the caller holds
 * a tensor on that memory. */
tshare_host_buffer *py_memory_host_buffer_at(uintptr_t addr);

/* As py_memory_host_buffer_at, among the buffers made here alone (not those
 * over torch's shared memory lent to a set send, which another thread's set
 * send may drop while the caller's share is under way without the GIL). */
tshare_host_buffer *py_memory_made_host_buffer_at(uintptr_t addr);

/* A host buffer over the file of torch's shared memory (fd of size bytes,
 * mapped here at base), found by address like the others (a tensor set's
 * members) while the capsule returned lives; the buffer holds storage until
 * its last share is released. NULL with a Python error on failure. */
PyObject *py_memory_adopt_file(int fd, size_t size, uintptr_t base, PyObject *storage);

#endif /* TSHARE_PY_MEMORY_H */
