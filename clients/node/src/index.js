'use strict';
/**
 * trio-mesh for Node.js: a client (enqueue, ensure, cancel, reconcile, await a
 * result) and a worker peer (leases, fencing tokens, persistent tasks, cancels,
 * graceful stop, reaping) that shares a namespace with the Python peers.
 * protocol/README.md in the trio-mesh repository is the contract.
 */
const { Client } = require('./client');
const { Worker } = require('./worker');
const { PROTOCOL_VERSION, Keys } = require('./keys');
const errors = require('./errors');

module.exports = {
  Client,
  Worker,
  Keys,
  PROTOCOL_VERSION,
  MeshError: errors.MeshError,
  FencedError: errors.FencedError,
  VersionError: errors.VersionError,
  ConflictError: errors.ConflictError,
  DuplicateWorkerError: errors.DuplicateWorkerError,
  CommandError: errors.CommandError,
  DeadLetterError: errors.DeadLetterError,
};
