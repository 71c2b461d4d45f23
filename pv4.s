	.file	"<string>"
	.section	.ltext,"axl",@progbits
	.globl	_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax,@function
_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax:
	movq	8(%rsp), %rax
	vbroadcastss	(%r9), %zmm0
	vmulps	(%r8), %zmm0, %zmm3
	vmulps	64(%r8), %zmm0, %zmm2
	vmulps	128(%r8), %zmm0, %zmm1
	vmulps	192(%r8), %zmm0, %zmm0
	vbroadcastss	4(%r9), %zmm4
	vmulps	(%r8,%rax,4), %zmm4, %zmm7
	vmulps	64(%r8,%rax,4), %zmm4, %zmm6
	vmulps	128(%r8,%rax,4), %zmm4, %zmm5
	vmulps	192(%r8,%rax,4), %zmm4, %zmm4
	vbroadcastss	8(%r9), %zmm10
	vmulps	(%r8,%rax,8), %zmm10, %zmm9
	vmulps	64(%r8,%rax,8), %zmm10, %zmm8
	leaq	(,%rax,4), %r10
	vmulps	128(%r8,%rax,8), %zmm10, %zmm11
	vmulps	192(%r8,%rax,8), %zmm10, %zmm10
	leaq	(%rax,%rax,2), %rsi
	vbroadcastss	12(%r9), %zmm12
	vmulps	(%r8,%rsi,4), %zmm12, %zmm15
	vmulps	64(%r8,%rsi,4), %zmm12, %zmm14
	vmulps	128(%r8,%rsi,4), %zmm12, %zmm13
	vmulps	192(%r8,%rsi,4), %zmm12, %zmm12
	addq	$192, %rcx
	xorl	%r9d, %r9d
	.p2align	4
.LBB0_1:
	vbroadcastss	(%rdx,%r9), %zmm16
	vmovups	-192(%rcx), %zmm17
	vmovups	-128(%rcx), %zmm18
	vmovups	-64(%rcx), %zmm19
	vmovups	(%rcx), %zmm20
	vfmadd231ps	%zmm16, %zmm17, %zmm3
	vfmadd231ps	%zmm16, %zmm18, %zmm2
	vfmadd231ps	%zmm16, %zmm19, %zmm1
	vfmadd231ps	%zmm16, %zmm20, %zmm0
	vbroadcastss	4(%rdx,%r9), %zmm16
	vfmadd231ps	%zmm16, %zmm17, %zmm7
	vfmadd231ps	%zmm16, %zmm18, %zmm6
	vfmadd231ps	%zmm16, %zmm19, %zmm5
	vfmadd231ps	%zmm16, %zmm20, %zmm4
	vbroadcastss	8(%rdx,%r9), %zmm16
	vfmadd231ps	%zmm16, %zmm17, %zmm9
	vfmadd231ps	%zmm16, %zmm18, %zmm8
	vfmadd231ps	%zmm16, %zmm19, %zmm11
	vfmadd231ps	%zmm16, %zmm20, %zmm10
	vbroadcastss	12(%rdx,%r9), %zmm16
	vfmadd231ps	%zmm17, %zmm16, %zmm15
	vfmadd231ps	%zmm18, %zmm16, %zmm14
	vfmadd231ps	%zmm19, %zmm16, %zmm13
	vfmadd231ps	%zmm16, %zmm20, %zmm12
	addq	$256, %r9
	addq	%r10, %rcx
	cmpq	$16384, %r9
	jne	.LBB0_1
	vmovups	%zmm3, (%r8)
	vmovups	%zmm2, 64(%r8)
	vmovups	%zmm1, 128(%r8)
	vmovups	%zmm0, 192(%r8)
	vmovups	%zmm7, (%r8,%rax,4)
	vmovups	%zmm6, 64(%r8,%rax,4)
	vmovups	%zmm5, 128(%r8,%rax,4)
	vmovups	%zmm4, 192(%r8,%rax,4)
	vmovups	%zmm9, (%r8,%rax,8)
	vmovups	%zmm8, 64(%r8,%rax,8)
	vmovups	%zmm11, 128(%r8,%rax,8)
	vmovups	%zmm10, 192(%r8,%rax,8)
	vmovups	%zmm15, (%r8,%rsi,4)
	vmovups	%zmm14, 64(%r8,%rsi,4)
	vmovups	%zmm13, 128(%r8,%rsi,4)
	vmovups	%zmm12, 192(%r8,%rsi,4)
	movq	$0, (%rdi)
	xorl	%eax, %eax
	vzeroupper
	retq
.Lfunc_end0:
	.size	_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax, .Lfunc_end0-_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax

	.globl	_ZN7cpython8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	_ZN7cpython8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax,@function
_ZN7cpython8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax:
	.cfi_startproc
	pushq	%r14
	.cfi_def_cfa_offset 16
	pushq	%rbx
	.cfi_def_cfa_offset 24
	subq	$40, %rsp
	.cfi_def_cfa_offset 64
	.cfi_offset %rbx, -24
	.cfi_offset %r14, -16
	movq	%rsi, %rdi
	subq	$8, %rsp
	.cfi_adjust_cfa_offset 8
	leaq	8(%rsp), %r10
	leaq	16(%rsp), %r11
	leaq	24(%rsp), %rbx
	movabsq	$.const.pv4, %rsi
	movabsq	$PyArg_UnpackTuple, %r14
	leaq	40(%rsp), %r8
	leaq	32(%rsp), %r9
	movl	$5, %edx
	movl	$5, %ecx
	xorl	%eax, %eax
	pushq	%r10
	.cfi_adjust_cfa_offset 8
	pushq	%r11
	.cfi_adjust_cfa_offset 8
	pushq	%rbx
	.cfi_adjust_cfa_offset 8
	callq	*%r14
	addq	$32, %rsp
	.cfi_adjust_cfa_offset -32
	testl	%eax, %eax
	je	.LBB1_4
	movabsq	$_ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax, %rax
	cmpq	$0, (%rax)
	je	.LBB1_2
	movabsq	$PyExc_TypeError, %rdi
	movabsq	$".const.can't unbox float32* type", %rsi
.LBB1_3:
	movabsq	$PyErr_SetString, %rax
	callq	*%rax
.LBB1_4:
	xorl	%eax, %eax
	addq	$40, %rsp
	.cfi_def_cfa_offset 24
	popq	%rbx
	.cfi_def_cfa_offset 16
	popq	%r14
	.cfi_def_cfa_offset 8
	retq
.LBB1_2:
	.cfi_def_cfa_offset 64
	movabsq	$PyExc_RuntimeError, %rdi
	movabsq	$".const.missing Environment: _ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax", %rsi
	jmp	.LBB1_3
.Lfunc_end1:
	.size	_ZN7cpython8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax, .Lfunc_end1-_ZN7cpython8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax
	.cfi_endproc

	.globl	cfunc._ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax
	.p2align	4
	.type	cfunc._ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax,@function
cfunc._ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax:
	.cfi_startproc
	pushq	%r14
	.cfi_def_cfa_offset 16
	pushq	%rbx
	.cfi_def_cfa_offset 24
	subq	$24, %rsp
	.cfi_def_cfa_offset 48
	.cfi_offset %rbx, -24
	.cfi_offset %r14, -16
	movq	%rcx, %r9
	movq	%rdx, %rax
	movq	%rsi, %rcx
	movq	%rdi, %rdx
	movq	$0, 16(%rsp)
	movq	%r8, (%rsp)
	movabsq	$_ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax, %rsi
	leaq	16(%rsp), %rdi
	movq	%rax, %r8
	callq	*%rsi
	movq	16(%rsp), %rcx
	movl	$0, 12(%rsp)
	testl	%eax, %eax
	jne	.LBB2_1
.LBB2_5:
	movq	%rcx, %rax
	addq	$24, %rsp
	.cfi_def_cfa_offset 24
	popq	%rbx
	.cfi_def_cfa_offset 16
	popq	%r14
	.cfi_def_cfa_offset 8
	retq
.LBB2_1:
	.cfi_def_cfa_offset 48
	movq	%rcx, %r14
	movabsq	$numba_gil_ensure, %rcx
	leaq	12(%rsp), %rdi
	movl	%eax, %ebx
	callq	*%rcx
	testl	%ebx, %ebx
	jg	.LBB2_2
	movl	%ebx, %eax
	cmpl	$-1, %ebx
	je	.LBB2_4
	cmpl	$-3, %eax
	jne	.LBB2_3
	movabsq	$PyExc_StopIteration, %rdi
	movabsq	$PyErr_SetNone, %rax
	callq	*%rax
	jmp	.LBB2_4
.LBB2_3:
	movabsq	$PyExc_SystemError, %rdi
	movabsq	$".const.unknown error when calling native function", %rsi
	movabsq	$PyErr_SetString, %rax
	callq	*%rax
.LBB2_4:
	movabsq	$".const.<numba.core.cpu.CPUContext>", %rdi
	movabsq	$PyUnicode_FromString, %rax
	callq	*%rax
	movq	%rax, %rbx
	movabsq	$PyErr_WriteUnraisable, %rax
	movq	%rbx, %rdi
	callq	*%rax
	movabsq	$Py_DecRef, %rax
	movq	%rbx, %rdi
	callq	*%rax
	movabsq	$numba_gil_release, %rax
	leaq	12(%rsp), %rdi
	callq	*%rax
	movq	%r14, %rcx
	jmp	.LBB2_5
.LBB2_2:
	movabsq	$PyErr_Clear, %rax
	callq	*%rax
.Lfunc_end2:
	.size	cfunc._ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax, .Lfunc_end2-cfunc._ZN8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax
	.cfi_endproc

	.type	.const.pv4,@object
	.section	.lrodata,"al",@progbits
.const.pv4:
	.asciz	"pv4"
	.size	.const.pv4, 4

	.type	_ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax,@object
	.comm	_ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax,8,8
	.type	".const.missing Environment: _ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax",@object
	.p2align	4, 0x0
".const.missing Environment: _ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax":
	.asciz	"missing Environment: _ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax"
	.size	".const.missing Environment: _ZN08NumbaEnv8__main__3pv4B2v7B124c8tJTIeFIjxB2IKSgI4CrvSCKg1MMbCQQPKkLTj8gEEF9aYtuj_2br1ROLkgvUdRTUk_2fPzSooSk0tA7MS0PBBVBExpxfnJIGZecZV6rSYwPoog9moCAA_3d_3dE10float32_2a10float32_2a10float32_2a10float32_2ax", 230

	.type	".const.can't unbox float32* type",@object
	.p2align	4, 0x0
".const.can't unbox float32* type":
	.asciz	"can't unbox float32* type"
	.size	".const.can't unbox float32* type", 26

	.type	".const.unknown error when calling native function",@object
	.p2align	4, 0x0
".const.unknown error when calling native function":
	.asciz	"unknown error when calling native function"
	.size	".const.unknown error when calling native function", 43

	.type	".const.<numba.core.cpu.CPUContext>",@object
	.p2align	4, 0x0
".const.<numba.core.cpu.CPUContext>":
	.asciz	"<numba.core.cpu.CPUContext>"
	.size	".const.<numba.core.cpu.CPUContext>", 28

	.type	_ZN08NumbaEnv10sdpa_numba3cpu11microkernel10_pass_rows12_3clocals_3e12_3clambda_3eB2v6B122c8tJTIeFIjxB2IKSgI4CrvQCk0Z4yRYcWsCAgXrKFt1X1eqJRckF6joK6sn5eSVFicklIHZiWh6IKgKmq_2bL8ZBAzr7hKvVYTGPoY6QNqKTB8wSxNAA_3d_3dE10float32_2ax,@object
	.comm	_ZN08NumbaEnv10sdpa_numba3cpu11microkernel10_pass_rows12_3clocals_3e12_3clambda_3eB2v6B122c8tJTIeFIjxB2IKSgI4CrvQCk0Z4yRYcWsCAgXrKFt1X1eqJRckF6joK6sn5eSVFicklIHZiWh6IKgKmq_2bL8ZBAzr7hKvVYTGPoY6QNqKTB8wSxNAA_3d_3dE10float32_2ax,8,8
	.section	".note.GNU-stack","",@progbits
