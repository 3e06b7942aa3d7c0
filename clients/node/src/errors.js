'use strict';
/**
 * Errors. A script's error reply starts with a stable code
 * (protocol/README.md, "Error codes"); each code has its class here.
 */

class MeshError extends Error {
  /**
   * @param {string} message
   * @param {string} [code]
   */
  constructor(message, code) {
    super(message);
    this.name = this.constructor.name;
    /** The protocol's error code, when the error came from a script. */
    this.code = code;
  }
}
/** The worker holds no lease (expired, recycled) or another incarnation holds it. */
class FencedError extends MeshError {}
/** The namespace holds another protocol version. */
class VersionError extends MeshError {}
/** A payload is persistent and cannot be enqueued, or the reverse. */
class ConflictError extends MeshError {}
/** A worker id is live or not yet recycled. */
class DuplicateWorkerError extends MeshError {}
/** Any other error reply of a script (NOT_SERVING, BAD_ARG, ...). */
class CommandError extends MeshError {}
/** A task was dead-lettered: its last allowed attempt failed. */
class DeadLetterError extends MeshError {
  /**
   * @param {string} message
   * @param {{attempts: number, error: string, worker: string, when: number}} deadLetter
   */
  constructor(message, deadLetter) {
    super(message, 'DEAD_LETTER');
    this.deadLetter = deadLetter;
  }
}

/** @type {Record<string, new (message: string, code?: string) => MeshError>} */
const BY_CODE = {
  FENCED: FencedError,
  VERSION: VersionError,
  CONFLICT: ConflictError,
  DUPLICATE_WORKER: DuplicateWorkerError,
  NOT_SERVING: CommandError,
  BAD_ARG: CommandError,
};

/**
 * A script's error reply as one of the classes above; any other error as is.
 * @param {unknown} err
 * @returns {unknown}
 */
function mapError(err) {
  if (!(err instanceof Error) || err.name !== 'ReplyError') return err;
  const code = err.message.split(' ', 1)[0];
  const cls = BY_CODE[code];
  if (!cls) return err;
  return new cls(err.message.slice(code.length + 1), code);
}

module.exports = {
  MeshError, FencedError, VersionError, ConflictError, DuplicateWorkerError, CommandError,
  DeadLetterError, mapError,
};
