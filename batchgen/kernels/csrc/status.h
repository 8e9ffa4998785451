/*
 * The status every C kernel of batchgen returns; kernel_status.py names each one and turns it
 * into the caller's answer (STATUS_UNSUPPORTED: the kernel wrote nothing, run another path).
 */
#ifndef BATCHGEN_STATUS_H
#define BATCHGEN_STATUS_H

enum {
    STATUS_OK = 0,
    STATUS_BAD_CONTEXT_LEN = 1, /* a context length < 1 or past the block table, or a query count < 1 or past it */
    STATUS_BAD_BLOCK_ID = 2,    /* a block table entry outside [0, num_blocks) */
    STATUS_UNSUPPORTED = 3,     /* this build has no code for the dtype, head size, block size or head group */
    STATUS_NO_MEMORY = 4,       /* scratch memory could not be allocated */
    STATUS_BAD_GROUP = 5,       /* a shared-prefix group breaks its invariants */
    STATUS_BAD_SLOT = 6         /* a slot outside the pool */
};

#endif
